"""The backend: Dynamo's graph through fusepass's pipeline to a compiled callable.

    capture     Dynamo graph → functional ATen graph, before autograd
    attention   matmul → softmax → matmul → one fused flash-attention op (before autograd, so the
                backward never keeps the N×N probabilities)
    autograd    AOTAutograd splits forward and backward graphs
    elementwise pointwise chains in both graphs → generated Triton kernels
    report      each compiled graph's records get their roofline estimates; once the forward graph and,
                where a gradient flows, the backward graph are compiled, the report hook runs
                (FUSEPASS_REPORT, fusepass/report/hooks.py)
A step that fails leaves the graph as it was, with a warning and a hotspot (``strict=True`` raises).
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

from fusepass.attention.rewrite import list_unfused_attention, rewrite_attention
from fusepass.capture import capture, carry_input_sources
from fusepass.context import CONTROL_FLOW, PassContext, graph_device
from fusepass.elementwise import softmax_loss
from fusepass.elementwise.fuse import fuse_elementwise
from fusepass.matmul.pad import pad_matmuls
from fusepass.matmul.pads_in_producers import write_pads_in_producers
from fusepass.options import Options
from fusepass.report import hooks, profile, roofline
from fusepass.report.aten_ops import aten_ops
from fusepass.report.intermediates import largest_intermediates
from fusepass.report.records import Hotspot
from fusepass.report.report import Report, discard, new_report
from fusepass.runnable import copy_graph, on_device, runnable
from fusepass.runtime import whole_graphs
from fusepass.runtime.device import interpreter_asked_late, interpreting
from fusepass.runtime.host_scalars import host_scalars_made_on_device
from fusepass.saved_values import partition_with
from fusepass.split import compile_around_higher_order_ops, has_higher_order_ops

CPU_NOTICE = ("kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU): rewrites are planned and "
              "reported, the graph runs its ops unfused")
LATE_INTERPRETER_NOTICE = ("TRITON_INTERPRET=1 was set after fusepass was imported, too late for its kernels: set it "
                           "before the import to run them through Triton's interpreter")


def kernels_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


class _Compiling:
    """A report while its graphs compile. Each compiled graph gives the new records their roofline
    estimates; the report is complete, and its hook runs, once every forward graph is compiled and every
    backward graph that follows one (AOTAutograd compiles a backward graph at the first backward call)."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.forwards_done = False
        self.backwards_pending = 0

    def forward_compiled(self, backward_follows: bool) -> None:
        self.backwards_pending += backward_follows
        self.settle()

    def backward_compiled(self) -> None:
        self.backwards_pending -= 1
        self.settle()

    def all_forwards_compiled(self) -> None:
        self.forwards_done = True
        self.settle()

    def settle(self) -> None:
        try:
            roofline.estimate(self.report)
            if self.forwards_done and not self.backwards_pending and not self.report.complete:
                hooks.report_complete(self.report)
        except Exception as error:  # reporting never breaks the model
            warnings.warn(f"fusepass: completing the report failed ({type(error).__name__}: {error})",
                          RuntimeWarning, stacklevel=2)


def _notice(report: Report, notice: str | None) -> None:
    if notice and notice not in report.notices:
        report.notices.append(notice)


SOURCES_LOST = ("the rewritten graph's inputs no longer match Dynamo's one to one: no parameter counts as static, "
                "so each whole-graph replay copies every parameter and buffer first")

# A graph whose first call compiles at least this many kernels says so as it compiles: each takes Triton about a
# second on the GPU machine the first time (then it comes from Triton's cache).
LONG_COMPILE_KERNELS = 16


def compile_notice(report: Report, phase: str, device: torch.device) -> str | None:
    """One line for a compile that will take long: what compiles, how many kernels."""
    kinds = [r.kind for r in report.rewrites if r.phase == phase and r.kind != "matmul"]
    if device.type != "cuda" or len(kinds) < LONG_COMPILE_KERNELS:
        return None
    attention = kinds.count("attention")
    return (f"fusepass: {report.graph} ({phase}) compiles {len(kinds)} kernels on its first call "
            f"({attention} attention, {len(kinds) - attention} fused); Triton caches them for later runs")


def _ceilings_notice(report: Report, device: torch.device) -> str | None:
    if device.type != "cuda" or report.ceilings.source != "default":
        return None
    name = torch.cuda.get_device_name(device)
    if "H200" in name:
        return None
    return (f"roofline estimates use the H200's ceilings on a {name}: give yours with fusepass.set_ceilings("
            "fusepass.measure_ceilings())")


# What fusepass does in place of Inductor's modes it has no counterpart of ("reduce-overhead" is the `graphs` option).
MODES = {
    "max-autotune": "its kernels' tiles are chosen per device and shape when they compile, with no search to ask for",
    "max-autotune-no-cudagraphs": "its kernels' tiles are chosen per device and shape when they compile, with no "
                                  "search to ask for",
}


class Backend:
    """A configured fusepass backend: ``torch.compile(model, backend=Backend(Options(...)))``."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __repr__(self) -> str:
        return f"fusepass.backend({self.options})"

    def reset(self) -> None:
        """What ``torch._dynamo.reset()`` asks of each backend it used: with `graphs`, the CUDA graph trees' recordings
        and their memory let go (as Dynamo's own cudagraphs backend does)."""
        if self.options.graphs and torch.cuda.is_available():
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable[..., Any]:
        """Compile one Dynamo graph. ``torch.compile(..., options={...})`` passes `options` (fusepass's, over this
        backend's) and ``mode=...`` `mode`, which names Inductor's modes: fusepass has one."""
        if mode == "reduce-overhead":
            options = {**(options or {}), "graphs": True}
        elif mode not in (None, "default"):
            raise ValueError(f"fusepass has no mode {mode!r}: {MODES.get(mode, 'modes name Inductor settings')}; "
                             "leave mode out")
        if options:
            return Backend(self.options.with_changes(**options))(gm, example_inputs)
        compiling = _Compiling(new_report())
        try:
            if has_higher_order_ops(gm):
                try:
                    compiled = compile_around_higher_order_ops(
                        gm, example_inputs, lambda piece, inputs: self._compile(piece, inputs, compiling))
                except Exception as error:
                    compiled = self._give_up(gm, compiling.report, "splitting at higher-order ops", error, 0)
            else:
                compiled = self._compile(gm, example_inputs, compiling)
        except CONTROL_FLOW:
            discard(compiling.report)  # Dynamo compiles the frame again, with a report of its own
            raise
        compiling.all_forwards_compiled()
        return compiled

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], compiling: _Compiling
                 ) -> Callable[..., Any]:
        report = compiling.report
        recorded = len(report.rewrites)
        try:
            graph = capture(gm, example_inputs)
        except Exception as error:
            return self._give_up(gm, report, "capture", error, recorded)
        device = graph_device(graph.graph)
        report.device = str(device)
        run_kernels = kernels_can_run(device)
        if not run_kernels:
            _notice(report, CPU_NOTICE)
            if device.type == "cpu" and interpreter_asked_late():
                _notice(report, LATE_INTERPRETER_NOTICE)
        _notice(report, profile.notice(device))
        _notice(report, _ceilings_notice(report, device))

        def context(phase: str) -> PassContext:
            return PassContext(report, self.options, phase, device, run_kernels)

        # Whole-graph replays hold no host tensor: the host's scalars are made on the device where they can be.
        replayed_whole = self.options.graphs and run_kernels and device.type == "cuda"
        if replayed_whole:
            graph = self._step(host_scalars_made_on_device, graph, context("forward"), "moving host scalars")
        if self.options.attention:
            graph = self._step(rewrite_attention, graph, context("forward"), "attention rewrite")
        else:
            graph = self._step(list_unfused_attention, graph, context("forward"), "listing attention")

        replays = whole_graphs.GraphsOfOneCompile(
            device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0))

        def compiler(phase: str, backward_follows: bool = False) -> Callable[..., Any]:
            def compile_graph(module: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                inference = phase == "forward" and not backward_follows
                if inference and fuses_rows:  # no partition writes its losses out
                    softmax_loss.write_out(module, losses_only=True)
                if replayed_whole:
                    module = self._step(host_scalars_made_on_device, module, context(phase), "moving host scalars")
                module = self._step(pad_matmuls, module, context(phase), "matmul padding")
                if self.options.elementwise:
                    module = self._step(fuse_elementwise, module, context(phase), "elementwise fusion")
                    module = self._step(write_pads_in_producers, module, context(phase), "padded outputs")
                report.graphs[phase] = module
                if run_kernels:  # otherwise the graph still holds what the rewrites would remove
                    self._list_aten_ops(module, context(phase))
                    notice = compile_notice(report, phase, device)
                    if notice:
                        print(notice, file=sys.stderr, flush=True)
                        _notice(report, notice)
                if phase == "backward":
                    compiling.backward_compiled()
                else:
                    if run_kernels:  # otherwise the graph still holds what the rewrites would remove
                        self._list_intermediates(module, context(phase))
                    compiling.forward_compiled(backward_follows)
                annotated = phase if self.options.annotate else None
                compiled = make_boxed_func(on_device(runnable(module, annotated).forward, device))
                if not replayed_whole:
                    return compiled

                def why_not(reason: str) -> None:
                    _notice(report, f"{report.graph} ({'inference' if inference else phase}) runs as compiled, "
                                    f"not replayed whole: {reason}")

                return whole_graphs.replayed(compiled, module, inputs, phase, inference, replays, why_not)

            return compile_graph

        fuses_rows = self.options.elementwise and self.options.reductions and run_kernels
        partition = partition_with(softmax_loss.write_out if fuses_rows else None)
        if not carry_input_sources(gm, graph) and self.options.graphs and "dynamo_compile_id" in gm.meta:
            _notice(report, SOURCES_LOST)
        try:
            # A forward graph compiled as the inference graph has no backward to wait for.
            return aot_module_simplified(graph, example_inputs, fw_compiler=compiler("forward", True),
                                         bw_compiler=compiler("backward"),
                                         inference_compiler=compiler("forward"),
                                         partition_fn=partition)
        except Exception as error:
            return self._give_up(gm, report, "autograd", error, recorded)

    def _step(self, step: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule],
              graph: torch.fx.GraphModule, ctx: PassContext, what: str) -> torch.fx.GraphModule:
        """Run one pass on a copy; if it fails, the graph goes on unchanged."""
        before = torch.fx.GraphModule(graph, copy_graph(graph.graph))
        try:
            return step(graph, ctx)
        except Exception as error:
            ctx.fallback("fallback", "?", f"{what} failed on the whole graph", error)
            return before

    def _list_aten_ops(self, graph: torch.fx.GraphModule, ctx: PassContext) -> None:
        try:
            ctx.report.hotspots.extend(aten_ops(graph.graph, ctx.phase, ctx.device, self.options.elementwise))
        except Exception as error:
            ctx.fallback("fallback", "?", "listing the ATen ops left failed", error)

    def _list_intermediates(self, graph: torch.fx.GraphModule, ctx: PassContext) -> None:
        try:
            ctx.report.hotspots.extend(largest_intermediates(graph.graph, ctx.phase))
        except Exception as error:
            ctx.fallback("fallback", "?", "listing the largest intermediates failed", error)

    def _give_up(self, gm: torch.fx.GraphModule, report: Report, step: str, error: Exception, recorded: int
                 ) -> Callable[..., Any]:
        """Run `gm` as Dynamo gave it. The rewrites recorded for it (those after the first `recorded`) do not
        run: each becomes a hotspot."""
        if self.options.strict or isinstance(error, CONTROL_FLOW):
            raise error
        warnings.warn(f"fusepass: {step} failed ({type(error).__name__}: {error}); running the graph "
                      "unfused", RuntimeWarning, stacklevel=2)
        reason = f"{step} failed: {type(error).__name__}: {error}"
        report.hotspots.append(Hotspot(kind="fallback", phase="forward", location="?", reason=reason))
        dropped, report.rewrites[recorded:] = report.rewrites[recorded:], []
        report.hotspots.extend(Hotspot(kind=r.kind, phase=r.phase, location=r.location, ops=r.ops,
                                       bytes=r.bytes_unfused, flops=r.flops,
                                       reason=f"not fused: the graph runs unfused ({step} failed)")
                               for r in dropped)
        return gm.forward


def backend(**options: Any) -> Backend:
    """A configured backend, e.g. ``torch.compile(m, backend=fusepass.backend(elementwise=False))``."""
    return Backend(Options.from_kwargs(**options))


fusepass_backend = Backend(Options())
