"""The table's activations (`rules.RULES`), and the backward ops AOTAutograd emits for them."""
from __future__ import annotations

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind

from fusepass.codegen.rules import clamp_expr, rule

aten = torch.ops.aten


@rule(aten.relu)
def _relu(c, self):
    # where, not maximum: NaN passes through as in eager.
    return f"tl.where({self} < 0, {c.lit(0)}, {self})"


@rule(aten.gelu)
def _gelu(c, self, approximate="none"):
    return f"fm.tanh_gelu({self})" if approximate == "tanh" else f"fm.erf_gelu({self})"


@rule(aten.silu)
def _silu(c, self):
    return f"({self} * tl.sigmoid({self}))"


@rule(aten.mish)
def _mish(c, self):
    return f"fm.mish({self})"


@rule(aten.leaky_relu)
def _leaky_relu(c, self, negative_slope=0.01):
    return f"tl.where({self} > 0, {self}, {self} * {c.lit(negative_slope)})"


@rule(aten.elu)
def _elu(c, self, alpha=1, scale=1, input_scale=1):
    return f"fm.elu({self}, {c.lit(alpha)}, {c.lit(scale)}, {c.lit(input_scale)})"


@rule(aten.logit, kind=Kind.INT_TO_FLOAT)
def _logit(c, self, eps=None):
    # The bounds in float32, as eager's CUDA kernel holds them (its CPU kernel rounds them to a half input's dtype).
    x = self if eps is None else clamp_expr(c, self, c.lit(eps), c.lit(1 - eps))
    return f"tl.log({x} / ({c.lit(1)} - {x}))"


@rule(aten.logit_backward, operands=("grad_output", "self"))
def _logit_backward(c, grad_output, self, eps=None):
    # Eager's: NaN outside [0, 1] without eps, 0 outside [eps, 1 - eps] with it.
    derivative = f"({grad_output} / ({self} * ({c.lit(1)} - {self})))"
    if eps is None:
        return f"tl.where(({self} < 0) | ({self} > 1), {c.lit(float('nan'))}, {derivative})"
    return f"tl.where(({self} < {c.lit(eps)}) | ({self} > {c.lit(1 - eps)}), {c.lit(0)}, {derivative})"


@rule(aten.celu)
def _celu(c, self, alpha=1.0):
    # ATen's celu is its elu with input_scale 1 / alpha.
    return _elu(c, self, alpha, 1, 1.0 / alpha)


@rule(aten.threshold)
def _threshold(c, self, threshold, value):
    return f"tl.where({self} <= {c.lit(threshold)}, {c.lit(value)}, {self})"


@rule(aten.softplus)
def _softplus(c, self, beta=1, threshold=20):
    return f"fm.softplus({self}, {c.lit(beta)}, {c.lit(threshold)})"


@rule(aten.hardsigmoid)
def _hardsigmoid(c, self):
    return f"({clamp_expr(c, f'({self} + {c.lit(3)})', c.lit(0), c.lit(6))} / {c.lit(6)})"


@rule(aten.hardswish)
def _hardswish(c, self):
    return f"({self} * {_hardsigmoid(c, self)})"


# Backward ops AOTAutograd emits for the activations above.

@rule(aten.threshold_backward, operands=("grad_output", "self"))
def _threshold_backward(c, grad_output, self, threshold):
    return f"tl.where({self} <= {c.lit(threshold)}, {c.lit(0)}, {grad_output})"


@rule(aten.sigmoid_backward, operands=("grad_output", "output"))
def _sigmoid_backward(c, grad_output, output):
    return f"({grad_output} * {output} * ({c.lit(1)} - {output}))"


@rule(aten.tanh_backward, operands=("grad_output", "output"))
def _tanh_backward(c, grad_output, output):
    return f"({grad_output} * ({c.lit(1)} - {output} * {output}))"


@rule(aten.gelu_backward, operands=("grad_output", "self"))
def _gelu_backward(c, grad_output, self, approximate="none"):
    fn = "fm.tanh_gelu_backward" if approximate == "tanh" else "fm.erf_gelu_backward"
    return f"{fn}({grad_output}, {self})"


@rule(aten.silu_backward, operands=("grad_output", "self"))
def _silu_backward(c, grad_output, self):
    return f"fm.silu_backward({grad_output}, {self})"


@rule(aten.leaky_relu_backward, operands=("grad_output", "self"))
def _leaky_relu_backward(c, grad_output, self, negative_slope, self_is_result):
    return f"tl.where({self} > 0, {grad_output}, {grad_output} * {c.lit(negative_slope)})"


@rule(aten.hardtanh_backward, operands=("grad_output", "self"))
def _hardtanh_backward(c, grad_output, self, min_val, max_val):
    return (f"tl.where(({self} <= {c.lit(min_val)}) | ({self} >= {c.lit(max_val)}), {c.lit(0)}, "
            f"{grad_output})")


@rule(aten.softplus_backward, operands=("grad_output", "self"))
def _softplus_backward(c, grad_output, self, beta, threshold):
    return f"fm.softplus_backward({grad_output}, {self}, {c.lit(beta)}, {c.lit(threshold)})"


@rule(aten.elu_backward, operands=("grad_output", "self_or_result"))
def _elu_backward(c, grad_output, alpha, scale, input_scale, is_result, self_or_result):
    x = self_or_result
    if is_result:
        negative = f"{grad_output} * {c.lit(input_scale)} * ({x} + {c.lit(alpha * scale)})"
        return f"tl.where({x} <= 0, {negative}, {grad_output} * {c.lit(scale)})"
    negative = (f"{grad_output} * {c.lit(input_scale)} * {c.lit(alpha * scale)} * "
                f"tl.exp({x} * {c.lit(input_scale)})")
    return f"tl.where({x} <= 0, {negative}, {grad_output} * {c.lit(scale)})"
