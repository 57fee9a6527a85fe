"""The backend: Dynamo's graph through fusepass's pipeline to a compiled callable.

    capture     Dynamo graph → functional ATen graph, before autograd
    attention   matmul → softmax → matmul → one fused flash-attention op (before autograd, so the
                backward never keeps the N×N probabilities)
    autograd    AOTAutograd splits forward and backward graphs
    elementwise pointwise chains in both graphs → generated Triton kernels
A step that fails leaves the graph as it was, with a warning and a hotspot (``strict=True`` raises).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._functorch.aot_autograd import aot_module_simplified

from fusepass.attention.rewrite import rewrite_attention
from fusepass.capture import capture
from fusepass.context import PassContext, graph_device
from fusepass.elementwise.fuse import fuse_elementwise
from fusepass.kernels.pointwise import interpreting
from fusepass.options import Options
from fusepass.report.records import Hotspot
from fusepass.report.report import Report, new_report
from fusepass.split import compile_around_higher_order_ops, has_higher_order_ops

CPU_NOTICE = ("kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU): rewrites are planned and "
              "reported, the graph runs its ops unfused")


def kernels_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


class Backend:
    """A configured fusepass backend: ``torch.compile(model, backend=Backend(Options(...)))``."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __repr__(self) -> str:
        return f"fusepass.backend({self.options})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        report = new_report()
        if has_higher_order_ops(gm):
            try:
                return compile_around_higher_order_ops(
                    gm, example_inputs, lambda piece, inputs: self._compile(piece, inputs, report))
            except Exception as error:
                return self._give_up(gm, report, "splitting at higher-order ops", error)
        return self._compile(gm, example_inputs, report)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], report: Report
                 ) -> Callable[..., Any]:
        try:
            graph = capture(gm, example_inputs)
        except Exception as error:
            return self._give_up(gm, report, "capture", error)
        device = graph_device(graph.graph)
        run_kernels = kernels_can_run(device)
        if not run_kernels:
            report.notices.append(CPU_NOTICE)

        def context(phase: str) -> PassContext:
            return PassContext(report, self.options, phase, device, run_kernels)

        if self.options.attention:
            graph = self._step(rewrite_attention, graph, context("forward"), "attention rewrite")

        def compiler(phase: str) -> Callable[..., Any]:
            def compile_graph(module: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                if self.options.elementwise:
                    module = self._step(fuse_elementwise, module, context(phase), "elementwise fusion")
                report.graphs[phase] = module
                return make_boxed_func(module.forward)

            return compile_graph

        try:
            return aot_module_simplified(graph, example_inputs, fw_compiler=compiler("forward"),
                                         bw_compiler=compiler("backward"),
                                         partition_fn=min_cut_rematerialization_partition)
        except Exception as error:
            return self._give_up(gm, report, "autograd", error)

    def _step(self, step: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule],
              graph: torch.fx.GraphModule, ctx: PassContext, what: str) -> torch.fx.GraphModule:
        """Run one pass on a copy; if it fails, the graph goes on unchanged."""
        before = torch.fx.GraphModule(graph, _copy_graph(graph.graph))
        try:
            return step(graph, ctx)
        except Exception as error:
            ctx.fallback("fallback", "?", f"{what} failed on the whole graph", error)
            return before

    def _give_up(self, gm: torch.fx.GraphModule, report: Report, step: str, error: Exception
                 ) -> Callable[..., Any]:
        if self.options.strict:
            raise error
        warnings.warn(f"fusepass: {step} failed ({type(error).__name__}: {error}); running the graph "
                      "unfused", RuntimeWarning, stacklevel=2)
        report.hotspots.append(Hotspot(kind="fallback", phase="forward", location="?",
                                       reason=f"{step} failed: {type(error).__name__}: {error}"))
        return gm.forward


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    return copy


def backend(**options: Any) -> Backend:
    """A configured backend, e.g. ``torch.compile(m, backend=fusepass.backend(elementwise=False))``."""
    return Backend(Options.from_kwargs(**options))


fusepass_backend = Backend(Options())
