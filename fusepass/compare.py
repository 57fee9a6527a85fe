"""``fusepass.compare``: a model under eager, Inductor and fusepass, side by side, on the caller's inputs.

Every backend's outputs, and with a loss every parameter's gradient, are checked against eager's: which
parameters got a gradient, and how far each value is from eager's (relative, by norm). On a CUDA device each
backend is timed in the same process (``triton.testing.do_bench`` medians): the forward, and with a loss the
training step (forward, loss, backward); its peak memory over a step, and its first call (the compile). Without a
GPU only the checks run.
"""
from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

BACKENDS = ("eager", "inductor", "fusepass")


@dataclass
class BackendResult:
    backend: str
    output_error: float  # relative to eager's outputs, by norm (0 for eager itself)
    # the largest over the parameters, each relative to its own norm or, where that is tiny (a gradient that is
    # exactly 0 but for rounding), to a thousandth of the largest parameter gradient's (None without a loss)
    gradient_error: float | None
    missing_gradients: list[str]  # parameters eager gives a gradient to and this backend does not
    # The same two against `reference` (the model in a wider dtype, eager), where one is given: for half-precision
    # models, where eager's own rounding is the bar.
    reference_output_error: float | None = None
    reference_gradient_error: float | None = None
    # the parameters whose gradients set gradient_error and reference_gradient_error
    worst_gradient: str | None = None
    worst_reference_gradient: str | None = None
    first_call_s: float | None = None  # the first call (its compile): forward, and backward with a loss
    forward_ms: float | None = None
    step_ms: float | None = None  # forward + loss + backward
    # over one step (or one forward without a loss), above what was allocated before the backend's first call: what it
    # keeps between calls (caches, CUDA graphs' pools) counts
    peak_memory_gib: float | None = None
    tokens_per_s: float | None = None  # of the step (of the forward without a loss), given `tokens`
    # output_error and gradient_error of a call after the timed ones (where launches and graphs replay), but eager's
    later_output_error: float | None = None
    later_gradient_error: float | None = None


@dataclass
class Comparison:
    results: list[BackendResult]
    device: str
    tokens: int | None = None
    reports: list[Any] = field(default_factory=list, repr=False)  # fusepass's reports of its compile

    def result(self, backend: str) -> BackendResult | None:
        return next((r for r in self.results if r.backend == backend), None)

    def speedup(self, backend: str, over: str, of: str = "step_ms") -> float | None:
        """How many times faster `backend` runs than `over` (`of`: "forward_ms" or "step_ms"); None where either
        was not run or not timed."""
        mine, theirs = self.result(backend), self.result(over)
        a, b = (getattr(mine, of), getattr(theirs, of)) if mine and theirs else (None, None)
        return b / a if a and b else None

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "tokens": self.tokens, "results": [asdict(r) for r in self.results]}

    def __str__(self) -> str:
        timed = any(r.forward_ms is not None for r in self.results)
        wide = any(r.reference_output_error is not None for r in self.results)
        later = any(r.later_output_error is not None for r in self.results)
        header = ["backend", "output error", "gradient error", "missing grads"]
        if later:
            header += ["later call: output", "gradients"]
        if wide:
            header += ["vs float32: output", "gradients"]
        if timed:
            header += ["first call s", "forward ms", "step ms", "peak GiB", "tokens/s"]
        rows = [header]
        for r in self.results:
            row = [r.backend, f"{r.output_error:.2e}",
                   "—" if r.gradient_error is None else f"{r.gradient_error:.2e}", str(len(r.missing_gradients))]
            if later:
                row += [_fmt(r.later_output_error, "{:.2e}"), _fmt(r.later_gradient_error, "{:.2e}")]
            if wide:
                row += [_fmt(r.reference_output_error, "{:.2e}"), _fmt(r.reference_gradient_error, "{:.2e}")]
            if timed:
                row += [_fmt(r.first_call_s, "{:.2f}"), _fmt(r.forward_ms, "{:.3f}"), _fmt(r.step_ms, "{:.3f}"),
                        _fmt(r.peak_memory_gib, "{:.2f}"), _fmt(r.tokens_per_s, "{:,.0f}")]
            rows.append(row)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                 for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        names = [r.backend for r in self.results]
        if timed and "fusepass" in names:
            for other in (n for n in names if n != "fusepass"):
                parts = [f"{label} {s:.2f}x" for label, of in (("forward", "forward_ms"), ("step", "step_ms"))
                         if (s := self.speedup("fusepass", other, of)) is not None]
                if parts:
                    lines.append(f"fusepass against {other}: " + ", ".join(parts))
        elif not timed:
            lines.append(f"on {self.device}: outputs and gradients checked; speed needs a CUDA device")
        return "\n".join(lines)


def _fmt(value: float | None, form: str) -> str:
    return "—" if value is None else form.format(value)


def _relative(actual: Any, expected: Any, floor: float = 0.0) -> float:
    """The largest relative distance (by norm) between the tensors of `actual` and `expected`, each scaled by its
    own norm or `floor`, whichever is larger."""
    worst = 0.0
    for a, e in zip(tree_leaves(actual), tree_leaves(expected)):
        if isinstance(e, torch.Tensor) and e.is_floating_point():
            scale = max(e.double().norm().item(), floor)
            error = (a.double() - e.double()).norm().item()
            worst = max(worst, error / scale if scale else error)
    return worst


def gradient_distances(grads: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None]
                       ) -> dict[str, float]:
    """Each parameter's gradient distance from `expected`'s, relative to its own norm or, where that is tiny, to a
    thousandth of the largest expected gradient's (see `BackendResult.gradient_error`); parameters both have."""
    largest = max((g.double().norm().item() for g in expected.values() if g is not None), default=0.0)
    return {n: _relative(grads[n], g, 1e-3 * largest) for n, g in expected.items()
            if g is not None and grads.get(n) is not None}


def _gradient_error(grads: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None]
                    ) -> tuple[float, str | None]:
    """(the largest of the parameters' gradient distances, `BackendResult.gradient_error`; its parameter)."""
    return max(((d, n) for n, d in gradient_distances(grads, expected).items()), default=(0.0, None))


def _compiled(model: torch.nn.Module | Callable, backend: str, options: dict[str, bool] | None) -> Callable:
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model)
    if backend.startswith("inductor-"):  # one of Inductor's modes
        return torch.compile(model, mode=backend.removeprefix("inductor-"))
    if backend == "fusepass":
        from fusepass.pipeline import backend as configured

        return torch.compile(model, backend=configured(**(options or {})))
    return torch.compile(model, backend=backend)


def _parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return list(model.named_parameters()) if isinstance(model, torch.nn.Module) else []


def compare(model: torch.nn.Module | Callable, *inputs: Any, loss: Callable[[Any], torch.Tensor] | None = None,
            backends: Sequence[str] = BACKENDS, tokens: int | None = None, reference: Any = None,
            reference_inputs: Sequence[Any] | None = None, warmup_ms: float = 100, rep_ms: float = 500,
            options: dict[str, bool] | None = None) -> Comparison:
    """Run `model(*inputs)` under each of `backends` ("eager", "inductor", "inductor-<mode>" for one of Inductor's
    modes, e.g. "inductor-reduce-overhead", "fusepass", or any other ``torch.compile`` backend by name). With
    `loss` (a function of the outputs returning a scalar) the training step runs too and every parameter's gradient
    is checked. `tokens`: how many tokens a call processes, for tokens/s.
    `reference` (with `reference_inputs`): the same model in a wider dtype (float32 for a bf16 model, its parameters
    named alike), run eagerly; every backend's distance from it is kept too. The result prints as a table and
    converts to a dict (`Comparison.to_dict`); ``result.reports`` holds fusepass's reports. `options`: fusepass's
    (``fusepass.backend(**options)``), its defaults where None. On a GPU each backend starts from
    ``torch._dynamo.reset()``, so that its peak memory counts its own graphs' pools alone: whatever else the process
    compiled compiles again on its next call."""
    import fusepass

    parameters = _parameters(model)
    device = next((t.device for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    on_gpu = device.type == "cuda"

    def zero_grads() -> None:
        for _, p in parameters:
            p.grad = None

    def run(fn: Callable) -> tuple[Any, dict[str, torch.Tensor | None]]:
        zero_grads()
        out = fn(*inputs)
        if loss is not None:
            loss(out).backward()
        return out, {name: None if p.grad is None else p.grad.detach().clone() for name, p in parameters}

    wide = wide_grads = None
    if reference is not None:
        reference_parameters = dict(_parameters(reference))
        for _, p in reference_parameters.items():
            p.grad = None
        wide = reference(*(reference_inputs or inputs))
        if loss is not None:
            loss(wide).backward()
        wide_grads = {n: None if p.grad is None else p.grad.detach() for n, p in reference_parameters.items()}
    expected, expected_grads = run(model)
    results = []
    for backend in backends:
        if backend == "fusepass":
            fusepass.reset()
        if on_gpu:
            _let_go_of_compiled()  # the previous backend's graphs and their pools are not this one's
        fn = _compiled(model, backend, options)
        if on_gpu:
            zero_grads()  # the previous backend's gradients are not this one's
            torch.cuda.synchronize()
            # What the backend holds between calls (its caches, CUDA graphs' pools) counts in its peak. Memory is
            # counted as reserved from the device, with the cache of freed blocks emptied first: a CUDA graph's
            # pool is reserved, not allocated, between its replays, which write it all the same.
            torch.cuda.empty_cache()
            held_before = torch.cuda.memory_reserved()
        started = time.perf_counter()
        out, grads = run(fn)
        if on_gpu:
            torch.cuda.synchronize()
        first_call = time.perf_counter() - started
        missing = [n for n, g in expected_grads.items() if g is not None and grads[n] is None]
        gradient_error, worst = (None, None) if loss is None else _gradient_error(grads, expected_grads)
        result = BackendResult(backend, _relative(out, expected), gradient_error, missing, worst_gradient=worst)
        if wide is not None:
            result.reference_output_error = _relative(out, wide)
            if loss is not None:
                result.reference_gradient_error, result.worst_reference_gradient = _gradient_error(grads, wide_grads)
        if backend != "eager":
            result.first_call_s = first_call
        del out, grads
        if on_gpu:
            _time(result, fn, inputs, loss, zero_grads, tokens, warmup_ms, rep_ms, held_before)
        if backend != "eager":
            later, later_grads = run(fn)
            result.later_output_error = _relative(later, expected)
            result.later_gradient_error = None if loss is None else _gradient_error(later_grads, expected_grads)[0]
            del later, later_grads  # may live in a CUDA graph's pool, which the next backend's count must not find held
        results.append(result)
        if backend == "fusepass":
            reports = fusepass.reports()
        del fn
    zero_grads()
    return Comparison(results, str(device), tokens, reports if "fusepass" in backends else [])


def _let_go_of_compiled() -> None:
    """Drop every compiled graph and every CUDA graph tree's recordings, with the memory pools they hold: the trees
    keep one pool per device for all backends, so a backend timed after Inductor's reduce-overhead would otherwise
    find its pool reserved already (and count none of its own)."""
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    torch._dynamo.reset()
    reset_cudagraph_trees()
    gc.collect()


def _time(result: BackendResult, fn: Callable, inputs: Sequence[Any], loss: Callable | None, zero_grads: Callable,
          tokens: int | None, warmup_ms: float, rep_ms: float, held_before: int) -> None:
    """The forward's and the step's times; the step's peak memory above what was reserved before the backend's
    first call (`held_before`)."""
    import triton.testing

    def bench(call: Callable[[], Any]) -> float:
        return triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    with torch.no_grad():
        result.forward_ms = bench(lambda: fn(*inputs))

    def step() -> None:
        zero_grads()
        out = fn(*inputs)
        if loss is not None:
            loss(out).backward()

    if loss is not None:
        result.step_ms = bench(step)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    result.peak_memory_gib = (torch.cuda.max_memory_reserved() - held_before) / 2**30
    ms = result.step_ms if result.step_ms is not None else result.forward_ms
    if tokens and ms and math.isfinite(ms):
        result.tokens_per_s = tokens / (ms * 1e-3)
