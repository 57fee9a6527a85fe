"""Shared checks: run a function eagerly and under fusepass, compare outputs and gradients.

Tensors live on the GPU when there is one (the compiled kernels run), else on the CPU (the interpreter).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fusepass
from fusepass.flash import hopper_backward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCES = {
    torch.float64: dict(rtol=1e-9, atol=1e-9),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


# A learned parameter's gradient that sums every score's (an ALiBi slope, a bias table entry) moves by ~1e-4 of
# its size in float32 with the order of that sum alone, past the elementwise float32 tolerance now and then.
SUMMED_GRADIENT_FP32 = dict(rtol=1e-3, atol=1e-3)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCES.get(dtype, dict(rtol=0, atol=0))


def _clone(x: object, requires_grad: bool) -> object:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        if requires_grad and x.is_floating_point():
            y.requires_grad_(True)
        return y
    return x


def assert_close(actual: object, expected: object, **tol: float) -> None:
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, **tol)
        return
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        t = tol or tolerance(expected.dtype)
        torch.testing.assert_close(actual, expected, equal_nan=True, **t)
        return
    assert actual == expected


LOW_PRECISION = (torch.float16, torch.bfloat16)


def _run(fn: Callable[..., object], inputs: Sequence[object], backward: bool, grads: list | None
         ) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Outputs and input gradients of ``fn`` (the output gradients are drawn on the first run)."""
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    input_grads: list[torch.Tensor] = []
    if backward:
        differentiable = [o for o in tensors if o.requires_grad]
        if grads is None:
            grads = [torch.randn_like(o) for o in differentiable]
        torch.autograd.backward(differentiable, [g.to(o.dtype) for g, o in zip(grads, differentiable)])
        input_grads = [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return tensors, input_grads, grads or []


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """The error's norm over the reference's, or the largest error where the reference is all zeros (a
    gradient that vanishes exactly in float64, e.g. of scores over a single key, is a few ulps of rounding
    in a flash backward, whose row term comes from the rounded output)."""
    a, r = actual.double(), reference.double()
    finite = torch.isfinite(r)
    assert torch.equal(finite, torch.isfinite(a)), "non-finite values differ"
    scale = r[finite].norm()
    if scale == 0:
        return (a - r)[finite].abs().max().item() if finite.any() else 0.0
    return ((a - r)[finite].norm() / scale).item()


def check(fn: Callable[..., object], *inputs: object, backward: bool = False,
          backend: object = "fusepass", slack: float | None = None, **tol: float) -> fusepass.Report:
    """``fn`` under fusepass computes what it computes eagerly, forward and (optionally) backward.

    In half precision eager is itself only an approximation: both are compared with ``fn`` run in float64,
    and fusepass may be at most twice as far from it as eager is, plus `slack` (by default a rounding of the
    dtype, or 2e-3 if more).
    """
    fusepass.reset()
    eager_inputs = [_clone(x, backward) for x in inputs]
    fused_inputs = [_clone(x, backward) for x in inputs]
    with LowPrecisionSeen() as seen:
        expected, expected_grads, grads = _run(fn, eager_inputs, backward, None)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    actual, actual_grads, _ = _run(compiled, fused_inputs, backward, grads)
    low = any(isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION for x in inputs) or seen.seen

    def reference() -> list:
        wide = [_clone(x, backward).double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x in inputs]
        wide = [w.detach().requires_grad_(backward) if isinstance(w, torch.Tensor) and w.is_floating_point()
                else w for w in wide]
        outputs, input_grads, _ = _run(fn, wide, backward, grads)
        return outputs + input_grads

    compare(actual + actual_grads, expected + expected_grads, reference, low, slack, **tol)
    report = fusepass.last_report()
    assert report is not None
    return report


def compare(actual: list, expected: list, reference: Callable[[], list], low: bool, slack: float | None = None,
            **tol: float) -> None:
    """fusepass's values (`actual`) against eager's (`expected`), with `reference()` the same computed in float64.

    Float32 (`low` False): within `tol` of eager, or else, element by element, no farther from float64 than twice
    eager's own distance plus `tol` (sinc's derivative near 0, where eager's float32 formula cancels), or else as a
    whole (norms) no farther than twice eager's distance plus `tol`'s rtol (a comparison of two values an ulp
    apart, computed by other formulas, decides an element otherwise than eager: eager differs from float64 at
    elements of its own). Half
    precision, or a program that rounds to it (`low`): as a whole (norms), at most twice as far from float64 as
    eager is, plus `slack` (by default a rounding of the dtype, or 2e-3 if more): a value rounded to bfloat16
    after float32 arithmetic that differs in its last bits may round to the other neighbour.
    """
    if not low:
        try:
            assert_close(actual, expected, **tol)
            return
        except AssertionError:
            wide = reference()
        t = tol or tolerance(torch.float32)
        for a, e, r in zip(actual, expected, wide):
            if e is None or not isinstance(e, torch.Tensor) or not e.is_floating_point():
                assert_close(a, e, **tol)
                continue
            assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
            a, e, r = a.double(), e.double(), r.double()
            assert torch.equal(a.isnan(), r.isnan() | e.isnan() & a.isnan()), "NaNs differ from float64's"
            ours, eagers = (a - r).abs().nan_to_num(0.0), (e - r).abs().nan_to_num(0.0)
            allowed = 2 * eagers + t["atol"] + t["rtol"] * r.abs().nan_to_num(0.0)
            if (ours <= allowed).all():
                continue
            worst = (ours - allowed).argmax()
            finite = torch.isfinite(r) & torch.isfinite(e)
            whole, eager_whole = relative_error(a[finite], r[finite]), relative_error(e[finite], r[finite])
            assert whole <= 2 * eager_whole + t["rtol"], \
                f"fusepass is {ours.flatten()[worst]:.3g} from float64 where eager is {eagers.flatten()[worst]:.3g}" \
                f" (as a whole {whole:.3g} against eager's {eager_whole:.3g})"
        return
    for a, e, r in zip(actual, expected, reference()):
        if e is None:  # an input the outputs do not depend on
            assert a is None
            continue
        assert a.dtype == e.dtype and a.shape == e.shape
        # Eager half precision may overflow or underflow to a non-finite value where float64 has a number
        # (atan2's gradient of tiny values: 0 · inf); its distance is taken where it has what float64 has.
        like_reference = torch.isfinite(e) == torch.isfinite(r)
        # fusepass may be non-finite where float64 is not only where eager is too: it computes what eager does
        mine = torch.isfinite(a) == torch.isfinite(r)
        assert not (~torch.isfinite(a) & torch.isfinite(e) & torch.isfinite(r)).any(), \
            "non-finite values where eager and float64 have numbers"
        assert not (torch.isfinite(a) & ~torch.isfinite(e) & ~torch.isfinite(r)).any(), \
            "numbers where eager and float64 are non-finite"
        ours, eagers = relative_error(a[mine], r[mine]), relative_error(e[like_reference], r[like_reference])
        # Plus a little: 2e-3, or one rounding of the dtype, the most a few bfloat16 values stored between
        # kernels can differ by (a 9-element gradient 1 ulp off on its largest entry is 7e-3 from float64).
        rounding = max(2e-3, torch.finfo(a.dtype).eps) if a.is_floating_point() else 2e-3
        allowed = rounding if slack is None else slack
        assert ours <= 2 * eagers + allowed, f"fusepass is {ours:.2e} from float64, eager {eagers:.2e}"


class LowPrecisionSeen(TorchDispatchMode):
    """Whether an op returned a half or bfloat16 tensor (a cast inside a program of float32 inputs): both are
    measured against float64 then (eager rounds every op after it, as fusepass does, but sums and other
    reassociations round otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen = self.seen or any(isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION
                                     for t in tree_leaves(out))
        return out


def missed(report: fusepass.Report) -> list:
    """The hotspots of what fusepass could have fused and did not (or fell back from): all but the ops it leaves to
    ATen by design (matmuls, ops without a fusion rule), which the report lists too."""
    return [h for h in report.hotspots if h.kind not in ("matmul", "aten")]


def rewrites(report: fusepass.Report, kind: str = "elementwise", phase: str | None = None) -> list:
    return [r for r in report.rewrites if r.kind == kind and (phase is None or r.phase == phase)]


def fused_kernel_count(report: fusepass.Report, phase: str = "forward") -> int:
    graph = report.graphs[phase].graph
    return sum(1 for n in graph.nodes if n.op == "call_function" and type(n.target).__name__ == "PointwiseLauncher")


def broken_source(*args, **kwargs) -> str:
    """A kernel's source that does not compile (monkeypatched in for `kernel_source`): its launch fails."""
    return "@triton.jit\ndef broken(:\n"


def random_tensor(shape: Sequence[int], dtype: torch.dtype, device: str = DEVICE, low: float = -3,
                  high: float = 3) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(int(low), int(high) + 1, shape, device=device, dtype=dtype)
    return (torch.rand(shape, device=device, dtype=torch.float64) * (high - low) + low).to(dtype)


def record_block_map_builds(monkeypatch) -> list[tuple[int, int, int]]:
    """The (block_m, block_n, kind_block_m) of every block map built from now on (`blockmap.build_block_map`,
    which still builds them); not of maps on "meta", which only start their kernels' compiles (the rewrite's)."""
    from fusepass.flash import blockmap

    build = blockmap.build_block_map
    signature = inspect.signature(build)
    built = []

    def recording(*args, **kwargs):
        tiles = signature.bind(*args, **kwargs).arguments
        if torch.device(tiles["device"]).type != "meta":
            built.append((tiles["block_m"], tiles["block_n"], tiles.get("kind_block_m") or tiles["block_m"]))
        return build(*args, **kwargs)

    monkeypatch.setattr(blockmap, "build_block_map", recording)
    return built


def pointwise_program(program: Sequence[tuple[bool, int, int, int]], n_inputs: int, unary: Sequence[Callable],
                      binary: Sequence[Callable]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The function a random program of pointwise steps computes: each step (binary?, op, a, b) applies
    ``unary[op]`` to value ``a`` or ``binary[op]`` to values ``a`` and ``b`` (indices taken modulo what is there:
    the inputs, then each step's result); it returns the last value and one intermediate."""
    def fn(*inputs):
        pool = list(inputs)
        for is_binary, op, a, b in program:
            if is_binary:
                pool.append(binary[op % len(binary)](pool[a % len(pool)], pool[b % len(pool)]))
            else:
                pool.append(unary[op % len(unary)](pool[a % len(pool)]))
        return pool[-1], pool[n_inputs + len(program) // 2]

    return fn


def last_attention():
    """The attention op compiled last (an `AttentionCall`: its spec, score functions and run-time state)."""
    from fusepass.attention.call import _calls

    return list(_calls.values())[-1]


def spec_of(fn: Callable[..., object], *inputs: object, exact: bool = True):
    """The spec of the attention `fn` compiles to (`last_attention`), after `check(fn, *inputs, backward=True)`, or,
    where not `exact` (a form whose eager values are not the ones to compare, such as its dropout's), after one
    compiled call."""
    if exact:
        check(fn, *inputs, backward=True)
    else:
        fusepass.reset()
        torch.compile(fn, backend="fusepass")(*inputs)
    return last_attention().spec


def sm90_backward_stand_in(monkeypatch, fn: Callable[..., object], *inputs: object) -> dict[str, object]:
    """`check(fn, *inputs, backward=True)` with the sm_90 backward said to serve every attention and replaced by a
    stand-in that fails (the replaced ops then run, with a warning naming it, and compute eager's gradients): the
    keyword arguments the stand-in was called with (a window's width, a key mask's keep, document ids) and whether
    causal (not the tensors it was given: on the GPU they lie in a CUDA graph's pool, which must not outlive it)."""
    seen = []

    def stand_in(*args, **keywords):
        seen.append({**keywords, "causal": inspect.signature(real).bind(*args, **keywords).arguments["causal"]})
        raise RuntimeError("the sm_90 backward's stand-in")

    real = hopper_backward.hopper_backward

    monkeypatch.setattr(hopper_backward, "serves", lambda *args: True)
    monkeypatch.setattr(hopper_backward, "available", lambda device: True)
    monkeypatch.setattr(hopper_backward, "hopper_backward", stand_in)
    with pytest.warns(RuntimeWarning, match="stand-in"):
        check(fn, *inputs, backward=True)
    (keywords,), = [seen]
    return keywords
