"""Every op of the translator's table against eager, in every dtype it takes, through a real kernel."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, assert_close, random_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.codegen.operands import held_dtype
from fusepass.elementwise.lower import lower
from fusepass.elementwise.partition import Group, is_constant
from fusepass.elementwise.kernel import PointwiseLauncher

aten = torch.ops.aten
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int32, torch.int64]
SHAPE = (7, 13)


def _raise(error: Exception) -> None:
    raise error


def run_one_kernel(fn, *inputs):
    """``fn``'s ops as ONE generated kernel, whatever their number (no partition heuristics)."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and not is_constant(n)]
    (out,) = [n for n in gm.graph.nodes if n.op == "output"][0].args[0],
    group = Group(nodes=nodes, outputs=[out])
    device = inputs[0].device
    launcher = PointwiseLauncher("kernel_under_test", lower(group, device), device, None, _raise)
    by_placeholder = dict(zip(placeholders, inputs))
    return launcher(*(by_placeholder[p] for p in group.inputs))[0]


def check_op(fn, *inputs, reference=None, **tol):
    expected = (reference or fn)(*inputs)
    actual = run_one_kernel(fn, *inputs)
    assert_close(actual, expected, **tol)


POSITIVE = dict(low=0.1, high=4)
UNIT = dict(low=-0.99, high=0.99)
UNARY_FLOAT = {
    "exp": (torch.exp, {}), "exp2": (torch.exp2, {}), "log": (torch.log, POSITIVE),
    "log2": (torch.log2, POSITIVE), "log10": (torch.log10, POSITIVE), "log1p": (torch.log1p, dict(low=-0.9)),
    "expm1": (torch.expm1, {}), "sqrt": (torch.sqrt, POSITIVE), "rsqrt": (torch.rsqrt, POSITIVE),
    "sin": (torch.sin, {}), "cos": (torch.cos, {}), "tan": (torch.tan, dict(low=-1.2, high=1.2)),
    "tanh": (torch.tanh, {}), "sigmoid": (torch.sigmoid, {}), "erf": (torch.erf, {}),
    "reciprocal": (torch.reciprocal, POSITIVE), "neg": (torch.neg, {}), "abs": (torch.abs, {}),
    "sign": (torch.sign, {}), "floor": (torch.floor, {}), "ceil": (torch.ceil, {}), "round": (torch.round, {}),
    "round_decimals": (lambda x: torch.round(x, decimals=2), {}), "trunc": (torch.trunc, {}),
    "relu": (torch.relu, {}), "gelu": (lambda x: F.gelu(x), {}),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), {}),
    "silu": (lambda x: F.silu(x), {}), "mish": (lambda x: F.mish(x), {}),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), {}),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 1.5), {}), "hardsigmoid": (lambda x: F.hardsigmoid(x), {}),
    "hardswish": (lambda x: F.hardswish(x), {}), "elu": (lambda x: F.elu(x), {}),
    "softplus": (lambda x: F.softplus(x, beta=2.0), {}),
    "clamp": (lambda x: torch.clamp(x, -1.0, 0.5), {}), "clamp_min": (lambda x: torch.clamp_min(x, 0.2), {}),
    "clamp_max": (lambda x: torch.clamp_max(x, 0.2), {}), "square": (lambda x: x ** 2, {}),
    "cube": (lambda x: x ** 3, {}), "pow_half": (lambda x: x ** 0.5, POSITIVE),
    "pow_minus_one": (lambda x: x ** -1, POSITIVE), "pow_frac": (lambda x: x ** 2.7, POSITIVE),
    "pow_negative_base": (lambda x: x ** 3.0 + x ** 2.5, {}), "isnan": (torch.isnan, {}),
    "isinf": (torch.isinf, {}), "isfinite": (torch.isfinite, {}), "logical_not": (torch.logical_not, {}),
    "nan_to_num": (lambda x: torch.nan_to_num(torch.log(x)), {}),
    "nan_to_num_values": (lambda x: torch.nan_to_num(torch.log(x), nan=1.0, posinf=2.0, neginf=-2.0), {}),
    "sgn": (torch.sgn, {}), "atan": (torch.atan, dict(low=-6, high=6)), "asin": (torch.asin, UNIT),
    "acos": (torch.acos, UNIT),
    "sinh": (torch.sinh, {}), "cosh": (torch.cosh, {}), "asinh": (torch.asinh, dict(low=-9, high=9)),
    "acosh": (torch.acosh, dict(low=1, high=9)), "atanh": (torch.atanh, UNIT), "deg2rad": (torch.deg2rad, {}),
    "rad2deg": (torch.rad2deg, {}), "frac": (torch.frac, dict(low=-9, high=9)),
    "celu": (lambda x: F.celu(x, alpha=0.7), {}), "threshold": (lambda x: F.threshold(x, 0.5, -2.0), {}),
    "lgamma": (torch.lgamma, dict(low=-6, high=12)), "digamma": (torch.digamma, dict(low=-6, high=12)),
    "erfc": (torch.erfc, dict(low=-3, high=6)), "erfinv": (torch.erfinv, UNIT),
    "sinc": (torch.sinc, dict(low=-6, high=6)), "trigamma": (lambda x: torch.polygamma(1, x), dict(low=-6, high=12)),
    "logit": (torch.logit, dict(low=-0.2, high=1.2)),
    "logit_eps": (lambda x: torch.logit(x, eps=0.01), dict(low=-0.2, high=1.2)),
}


# Where eager itself is inexact on CUDA: its hardsigmoid multiplies by a float32 1/6 even in float64.
CUDA_EAGER_TOLERANCE = {("hardsigmoid", torch.float64): dict(rtol=1e-7, atol=1e-7),
                        ("hardswish", torch.float64): dict(rtol=1e-7, atol=1e-7)}


# Where eager's CPU kernel differs from its CUDA kernel, which the generated kernels follow: CPU logit rounds its
# eps bounds to a half input's dtype (bfloat16's 1 - 0.01 is 0.988), CUDA holds them in float32; CUDA
# round(decimals) scales in a half input's dtype, CPU in float.
CUDA_EAGER = {"logit_eps": lambda x: torch.logit(x.to(held_dtype(x.dtype)), eps=0.01).to(x.dtype),
              "round_decimals": lambda x: _cuda_round(x, 2)}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", sorted(UNARY_FLOAT))
def test_unary_float(name, dtype):
    fn, domain = UNARY_FLOAT[name]
    tol = CUDA_EAGER_TOLERANCE.get((name, dtype), {}) if DEVICE == "cuda" else {}
    reference = CUDA_EAGER.get(name) if DEVICE == "cpu" else None
    x = random_tensor(SHAPE, dtype, **domain)
    if name.startswith("nan_to_num"):
        x[0, :3] = torch.tensor([0.0, -1.0, float("inf")], dtype=dtype, device=DEVICE)  # -inf, nan, inf after log
    if name in ("isnan", "isinf", "isfinite"):
        x[1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype, device=DEVICE)
    check_op(fn, x, reference=reference, **tol)


def test_float32_special_functions_stay_accurate_near_zero():
    x = torch.cat([torch.logspace(-8, 0, 40), -torch.logspace(-8, 0, 40)]).to(DEVICE)
    for fn in (torch.tanh, torch.expm1, torch.log1p, lambda x: F.mish(x)):
        check_op(fn, x, rtol=2e-6, atol=1e-12)


def _cuda_round(x, decimals):
    """Eager CUDA's round(decimals): the power of ten and the scaled value in x's dtype, the rest in float."""
    scale = torch.tensor(10.0 ** abs(decimals), dtype=x.dtype, device=x.device)
    held = held_dtype(x.dtype)
    if decimals > 0:
        return (torch.round(x * scale).to(held) / scale.to(held)).to(x.dtype)
    return (torch.round(x / scale).to(held) * scale.to(held)).to(x.dtype)


@pytest.mark.parametrize("decimals", [2, -1, 5])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_round_decimals_on_every_value_of_a_range(dtype, decimals):
    # Every value of the dtype in [-20, 20] (float32 and float64: a fine grid): the ties the scaled value's
    # rounding makes (a half 2.205 times 100 is 220.5) are all there. A half's 10^5 is inf: NaN, as eager.
    if dtype in (torch.float16, torch.bfloat16):
        bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
        x = bits[bits.float().abs() <= 20]
    else:
        x = torch.linspace(-20, 20, 40001, dtype=dtype)
    x = x.to(DEVICE)
    fn = lambda x: torch.round(x, decimals=decimals)  # noqa: E731
    check_op(fn, x, reference=(lambda x: _cuda_round(x, decimals)) if DEVICE == "cpu" else None, rtol=0, atol=0)


def test_round_is_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999, 1e8 + 0.0], device=DEVICE)
    check_op(torch.round, x, rtol=0, atol=0)


UNARY_INT = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "sgn": torch.sgn, "bitwise_not": torch.bitwise_not,
    "relu": torch.relu, "clamp": lambda x: torch.clamp(x, -2, 1), "square": lambda x: x ** 2,
    "pow_int": lambda x: x ** 5, "floor": torch.floor, "logical_not": torch.logical_not,
    "isnan": torch.isnan, "to_float": lambda x: x.float(),
    "true_divide_scalar": lambda x: x / 2, "floor_divide_scalar": lambda x: x // 3,
    "remainder_scalar": lambda x: x % 3, "sigmoid_promotes": torch.sigmoid, "mul_float": lambda x: x * 1.5,
}


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("name", sorted(UNARY_INT))
def test_unary_int(name, dtype):
    check_op(UNARY_INT[name], random_tensor(SHAPE, dtype, low=-9, high=9))


BINARY = {
    "add": torch.add, "add_alpha": lambda a, b: torch.add(a, b, alpha=2), "sub": torch.sub,
    "sub_alpha": lambda a, b: torch.sub(a, b, alpha=3), "rsub": lambda a, b: torch.rsub(a, b),
    "mul": torch.mul, "div": torch.div, "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"), "floor_divide": torch.floor_divide,
    "fmod": torch.fmod, "remainder": torch.remainder, "minimum": torch.minimum, "maximum": torch.maximum,
    "min_other": torch.min, "max_other": torch.max,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
    "where": lambda a, b: torch.where(a > b, a, b), "masked_fill": lambda a, b: a.masked_fill(b > 0, -7),
    "lerp_ish": lambda a, b: a + 0.25 * (b - a), "atan2": torch.atan2, "hypot": torch.hypot,
    "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2, "xlogy": lambda a, b: torch.xlogy(a, b.abs()),
    "copysign": torch.copysign, "fmax": torch.fmax, "fmin": torch.fmin,
}
# Eager implements these for floating dtypes only.
FLOAT_ONLY = {"hypot", "logaddexp", "logaddexp2"}


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x == 0, torch.ones_like(x), x)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name, dtype):
    a = random_tensor(SHAPE, dtype, low=-9, high=9)
    b = _nonzero(random_tensor(SHAPE, dtype, low=-9, high=9))
    if name == "div" and not dtype.is_floating_point:
        pytest.skip("eager integer true division is float; covered by test_mixed_dtypes")
    if name in FLOAT_ONLY and not dtype.is_floating_point:
        pytest.skip("eager has no integer kernel")
    reference = None
    if name in ("add_alpha", "sub_alpha") and dtype in (torch.float16, torch.bfloat16):
        # Eager's CPU kernel computes these in float32, except in the scalar tail of its vectorized loop
        # (elements past the last multiple of its vector width), which rounds alpha·b to half first: the
        # reference is the float32 arithmetic of its main loop, and of its CUDA kernel.
        def reference(a, b):
            return BINARY[name](a.float(), b.float()).to(dtype)
    check_op(BINARY[name], a, b, reference=reference)


def test_pow_tensor_exponent():
    base = random_tensor(SHAPE, torch.float32, low=0.1, high=3)
    exponent = random_tensor(SHAPE, torch.float32, low=-2, high=2)
    check_op(torch.pow, base, exponent)
    check_op(torch.pow, -base, exponent.round())


def test_pow_of_a_zero_dim_base():
    powers = torch.arange(1, 9, dtype=torch.int32, device=DEVICE)
    check_op(lambda p, b: torch.pow(b, p) * 2 - 1, powers, torch.tensor(0.0625, device=DEVICE))
    check_op(lambda p, b: torch.pow(b, p) + p, powers, torch.tensor(3, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64], ids=str)
def test_bitwise(dtype):
    a, b = random_tensor(SHAPE, dtype, low=-50, high=50), random_tensor(SHAPE, dtype, low=-50, high=50)
    check_op(lambda a, b: (a & b) | (a ^ b), a, b)
    check_op(lambda a, b: ~(a | b), a, b)
    if dtype != torch.bool:
        check_op(lambda a, b: (a << 2) ^ (b >> 1), a, b)


def test_ternary():
    a, b, c = (random_tensor(SHAPE, torch.float32) for _ in range(3))
    check_op(lambda a, b, c: torch.addcmul(a, b, c, value=0.5), a, b, c)
    check_op(lambda a, b, c: torch.addcdiv(a, b, _nonzero(c).abs() + 1, value=2), a, b, c)
    check_op(lambda a, b, c: torch.lerp(a, b, c), a, b, c)
    check_op(lambda a, b, c: torch.clamp(a, b, c), a, b, c)


BACKWARD_OPS = {
    "threshold_backward": lambda g, x: aten.threshold_backward(g, x, 0.0),
    "sigmoid_backward": lambda g, x: aten.sigmoid_backward(g, torch.sigmoid(x)),
    "tanh_backward": lambda g, x: aten.tanh_backward(g, torch.tanh(x)),
    "gelu_backward": lambda g, x: aten.gelu_backward(g, x),
    "gelu_backward_tanh": lambda g, x: aten.gelu_backward(g, x, approximate="tanh"),
    "silu_backward": lambda g, x: aten.silu_backward(g, x),
    "leaky_relu_backward": lambda g, x: aten.leaky_relu_backward(g, x, 0.1, False),
    "hardtanh_backward": lambda g, x: aten.hardtanh_backward(g, x, -1.0, 1.0),
    "softplus_backward": lambda g, x: aten.softplus_backward(g, x, 1.0, 20.0),
    "elu_backward": lambda g, x: aten.elu_backward(g, 1.0, 1.0, 1.0, False, x),
    "elu_backward_result": lambda g, x: aten.elu_backward(g, 1.0, 1.0, 1.0, True, F.elu(x)),
    "logit_backward": lambda g, x: aten.logit_backward(g, x.clamp(-0.25, 1.25)),
    "logit_backward_eps": lambda g, x: aten.logit_backward(g, x.clamp(-0.25, 1.25), 0.1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(BACKWARD_OPS))
def test_backward_ops(name, dtype):
    check_op(BACKWARD_OPS[name], random_tensor(SHAPE, dtype), random_tensor(SHAPE, dtype))


CASTS = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("source", CASTS, ids=str)
@pytest.mark.parametrize("target", CASTS, ids=str)
def test_casts_round_like_eager(source, target):
    x = random_tensor(SHAPE, source, low=-5, high=5)
    check_op(lambda x: (x * 3).to(target), x)


def test_mixed_dtypes_promote_like_eager():
    i32 = random_tensor(SHAPE, torch.int32, low=-9, high=9)
    i64 = _nonzero(random_tensor(SHAPE, torch.int64, low=-9, high=9))
    f16 = random_tensor(SHAPE, torch.float16)
    bf16 = random_tensor(SHAPE, torch.bfloat16)
    f32 = random_tensor(SHAPE, torch.float32)
    b = random_tensor(SHAPE, torch.bool)
    check_op(lambda a, b: a + b, i32, i64)
    check_op(lambda a, b: a / b, i32, i64)
    check_op(lambda a, b: a * b + 1, f16, bf16)
    check_op(lambda a, b: a * 2.5 + b, i32, f32)
    check_op(lambda a, b: a + b, b, i32)
    check_op(lambda a, b: torch.where(a, b, 0.5), b, bf16)
    check_op(lambda a, b: a.masked_fill(b, float("-inf")), bf16, b)
    check_op(lambda a, s: a * s, bf16, f32.sum())  # a 0-d float32 tensor does not promote bfloat16


def test_constants_are_inlined():
    x = random_tensor(SHAPE, torch.float32)
    check_op(lambda x: x + torch.full_like(x, 2.0) * torch.ones_like(x), x)
    check_op(lambda x: torch.where(x > 0, x, torch.zeros_like(x)), x)


def test_infinities_and_nans_propagate():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0], device=DEVICE)
    for fn in (torch.relu, lambda x: torch.clamp(x, -1, 1), torch.sigmoid, torch.tanh,
               lambda x: torch.maximum(x, torch.zeros_like(x)), lambda x: torch.minimum(x, -x)):
        check_op(fn, x)
    assert math.isnan(run_one_kernel(lambda x: torch.exp(x) * 0, x)[1].item())


def test_elementary_forms_and_bounds_at_infinities_and_nans():
    """log1p and expm1 (their cancelling forms are inf / inf at +inf), powers of -inf by non-integers (inf, not a
    negative base's NaN), and clamp's NaN bounds, tensor or scalar (NaN, as eager)."""
    special = torch.tensor(SPECIAL, device=DEVICE)
    for fn in (torch.log1p, torch.expm1):
        check_op(fn, special.abs() * 2 - 1)
    infinities = torch.tensor([-float("inf")] * 5 + [float("inf")] * 2, device=DEVICE)
    check_op(torch.pow, infinities, torch.tensor([2.5, -2.5, 3.0, -3.0, 0.5, 2.5, -0.5], device=DEVICE))
    x = torch.tensor([1.0, 2.0, -3.0, float("nan")], device=DEVICE)
    bound = torch.tensor([float("nan"), 5.0, float("nan"), 1.0], device=DEVICE)
    check_op(lambda x, low: torch.clamp(x * 2, min=low), x, bound)
    check_op(lambda x, high: torch.clamp(x * 2, max=high), x, bound)
    check_op(lambda x: torch.clamp(x * 2, min=float("nan")), x)
    check_op(lambda x: torch.clamp(x * 2, min=0.0, max=float("nan")), x)


SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 0.5, -0.5, 1e-30, -1e-30, 30.0, -30.0,
           100.0, 1e30, -1e30]
# On the GPU the kernels call what eager's CUDA kernels call for these (CUDA's math library): eager's own values.
# The interpreter computes them in float64 and rounds once: within an ulp of eager's float64 rounded to float32
# (eager's own float32 digamma is 4 ulp off at 0.5), and at float64 precision, absolute near lgamma's and
# digamma's zeros. The GPU's float32 digamma sums terms of a few units: within 1e-6 of float64 (eager's CUDA
# kernel is as far, near its root).
MATH_LIBRARY = {
    "atan": torch.atan, "asin": torch.asin, "acos": torch.acos, "sinh": torch.sinh, "cosh": torch.cosh,
    "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh, "lgamma": torch.lgamma, "digamma": torch.digamma,
    "erfc": torch.erfc, "erfinv": torch.erfinv,
}
# The interpreter's float64 erfc: 1 - erf(x) below 2 keeps 1e-14, the continued fraction past it exp(-x²)'s
# rounding of x² (6e-14 at 25).
FLOAT64_TOLERANCE = {"lgamma": dict(rtol=3e-14, atol=1e-14), "digamma": dict(rtol=3e-14, atol=1e-14),
                     "erfc": dict(rtol=1e-13, atol=0)}


@pytest.mark.parametrize("name", sorted(MATH_LIBRARY))
def test_math_library_functions_special_values_and_precision(name):
    fn = MATH_LIBRARY[name]
    def rounded(x):
        return fn(x.double()).float()

    own = DEVICE == "cuda" and name != "digamma"
    reference, atol = (fn, 0) if own else (rounded, 1e-6 if DEVICE == "cuda" else 0)
    if DEVICE == "cuda" and name == "erfc":  # Triton's libdevice flushes float32 subnormal results (past 9.1) to 0
        atol = torch.finfo(torch.float32).tiny
    special = torch.tensor(SPECIAL, device=DEVICE)
    check_op(fn, special, reference=reference, rtol=3e-7, atol=atol)  # ±0, infinities, NaN where eager has them
    wide = torch.cat([torch.logspace(-20, 2.5, 300), -torch.logspace(-20, 2.5, 300),
                      torch.linspace(-1, 1, 301), torch.linspace(-9.99, 9.99, 301)]).to(DEVICE)
    check_op(fn, wide.float(), reference=reference, rtol=3e-7, atol=atol)
    check_op(fn, wide.double(), **FLOAT64_TOLERANCE.get(name, dict(rtol=1e-14, atol=0)))
    if name == "erfinv":  # its other end: 1 - 1e-16 … 1 - 1e-2, where (1 - x) carries the digits
        near_one = 1.0 - torch.logspace(-16, -2, 200, dtype=torch.float64, device=DEVICE)
        check_op(fn, torch.cat([near_one, -near_one]), rtol=1e-14, atol=0)


BINARY_SPECIAL = {"atan2": torch.atan2, "hypot": torch.hypot, "logaddexp": torch.logaddexp,
                  "logaddexp2": torch.logaddexp2, "xlogy": torch.xlogy, "copysign": torch.copysign,
                  "fmax": torch.fmax, "fmin": torch.fmin, "min_other": torch.min, "max_other": torch.max}


@pytest.mark.parametrize("name", sorted(BINARY_SPECIAL))
def test_binary_special_values(name):
    values = torch.tensor(SPECIAL, device=DEVICE)
    a, b = torch.meshgrid(values, values, indexing="ij")
    fn = BINARY_SPECIAL[name]
    # Eager's float32 logaddexp2(-1, -1) is -1.06e-8 (a fused multiply-add), where 0 is exact.
    check_op(fn, a.contiguous(), b.contiguous(), rtol=3e-7, atol=2e-8)
    check_op(fn, a.double().contiguous(), b.double().contiguous(), rtol=1e-14, atol=1e-16)
    if name in ("atan2", "copysign"):  # the sign of a zero result too
        actual, expected = run_one_kernel(fn, a.contiguous(), b.contiguous()), fn(a, b)
        numbers = ~expected.isnan()
        assert torch.equal(torch.signbit(actual[numbers]), torch.signbit(expected[numbers]))


def test_pow_keeps_the_sign_of_a_zero_base():
    base = torch.tensor([-0.0, 0.0, -0.0, 0.0, -2.0], device=DEVICE)
    exponent = torch.tensor([-1.0, -1.0, 3.0, -2.0, 3.0], device=DEVICE)
    check_op(torch.pow, base, exponent, rtol=0, atol=0)
    assert torch.equal(torch.signbit(run_one_kernel(torch.pow, base, exponent)), torch.signbit(base ** exponent))


def test_negation_flips_the_sign_of_zero():
    x = torch.tensor([0.0, -0.0, 1.5, -2.0], device=DEVICE)
    assert torch.equal(torch.signbit(run_one_kernel(torch.neg, x)), torch.signbit(-x))
    assert torch.equal(torch.signbit(run_one_kernel(lambda x: x.neg() * 3, x)), torch.signbit(-x * 3))
