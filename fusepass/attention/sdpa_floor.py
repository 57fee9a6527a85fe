"""A floor under the fused kernels: torch's ``scaled_dot_product_attention`` where it computes the captured function
and the running GPU runs it faster.

SDPA computes ``softmax(q·kᵀ · scale [causal: -inf above the diagonal]) · v`` with K and V heads shared by
groups of query heads (``enable_gqa``). An attention is that function where its lifted chain is the scores times
a positive constant (`ScoreMod.linear_scale`), it reads no tensor, drops nothing, writes the inputs' dtype and
is either unmasked or masked with -inf by a mask of the positions alone over equal lengths; whether that mask
is SDPA's causal one (or a sliding window's band, which the sm_90 backward computes: `causal_band`) is checked at
each shape on the device, element by element (`_mask_kernel`). Then the
op's forward (and backward, where gradients flow) is timed on the running GPU both ways, once per class of
layouts (`layout_class`: batch and length rounded up to a power of two) and dtype, and SDPA runs where it takes
at most `FASTER` of the fused kernels' time. The rewrite's report record says so per shape, with both times.

SDPA's backward is its own autograd graph's: the forward runs SDPA under autograd and keeps the graph under
the storage of the lse the op returns (AOTAutograd saves it for the backward), as the dynamic op keeps its
forwards (`kept_forwards`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusepass.attention.kept_forwards import keep_forward, kept_forward
from fusepass.attention.plan import AttentionSpec
from fusepass.attention.unfused import autograd_enabled, with_strides
from fusepass.runtime.launch import launch
from fusepass.runtime.timing import median_ms

FASTER = 0.97  # SDPA runs where it takes at most this fraction of the fused kernels' time (the runs' spread)
_BLOCK = 64


@dataclass(frozen=True)
class SdpaForm:
    """The SDPA call an attention may be: its scale, whether its mask must be checked to be the causal one, and
    whether K and V heads are shared (`enable_gqa`)."""

    scale: float
    masked: bool
    gqa: bool


def sdpa_form(spec: AttentionSpec) -> SdpaForm | None:
    """The SDPA call `spec` may be, or None where no SDPA call computes its function."""
    lifted = spec.lifted
    if lifted.aux or lifted.tables or lifted.sizes or spec.dropout_p or lifted.linear_scale is None:
        return None
    masked = "keep" in lifted.functions
    if masked and (lifted.fill_bound != -float("inf") or lifted.keep_reads_aux
                   or not lifted.keep_uses <= {"q", "k"} or spec.q.size[2] != spec.k.size[2]):
        return None
    return SdpaForm(lifted.linear_scale, masked, spec.k.group > 1)


@triton.jit(do_not_specialize=["q_len", "kv_len", "window"])  # (as blockmap.BY_LENGTH)
def _mask_kernel(Differ, q_len, kv_len, window, aux, KEEP: tl.constexpr, BLOCK: tl.constexpr):
    """Counts where KEEP differs from a causal band of `window` keys, the query's own and those before it
    (Differ[0]; SDPA's causal mask where `window` ≥ q_len), and from keeping everything (Differ[1]), and the keys
    the last query row keeps (Differ[2]). The counts are int64: at lengths past 2^16 an int32 count of differences
    could wrap to 0."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    q_idx = tl.minimum(rows, q_len - 1)[:, None]
    kv_idx = tl.minimum(cols, kv_len - 1)[None, :]
    inside = (rows < q_len)[:, None] & (cols < kv_len)[None, :]
    kept = KEEP(0, 0, q_idx, kv_idx, aux) & inside  # a mask of one side broadcasts
    band = (kv_idx <= q_idx) & (q_idx - kv_idx < window) & inside
    tl.atomic_add(Differ, tl.sum((kept != band).to(tl.int64)))
    tl.atomic_add(Differ + 1, tl.sum((kept != inside).to(tl.int64)))
    tl.atomic_add(Differ + 2, tl.sum((kept & (rows == q_len - 1)[:, None]).to(tl.int64)))


def _differences(keep, aux: tuple, q_len: int, kv_len: int, window: int, device: torch.device) -> list[int]:
    """`_mask_kernel`'s counts."""
    differ = torch.zeros(3, dtype=torch.int64, device=device)
    launch(_mask_kernel, (triton.cdiv(q_len, _BLOCK), triton.cdiv(kv_len, _BLOCK)), differ, q_len, kv_len, window,
           aux, KEEP=keep, BLOCK=_BLOCK)
    return differ.tolist()


def sdpa_causal(keep, aux: tuple, q_len: int, kv_len: int, device: torch.device) -> bool | None:
    """Whether `keep` at these lengths is SDPA's causal mask (True), keeps everything (False), or neither."""
    as_causal, as_unmasked, _ = _differences(keep, aux, q_len, kv_len, q_len, device)
    return True if as_causal == 0 else False if as_unmasked == 0 else None


def causal_band(keep, aux: tuple, q_len: int, kv_len: int, device: torch.device) -> int | None:
    """The width w where `keep` at these lengths (equal) is a sliding window, each query keeping itself and the w - 1
    keys before it, with 1 ≤ w < the length; else None (a causal mask, which keeps them all, among the others). The
    last row keeps w keys of a band: the band of that width is then checked element by element."""
    *_, width = _differences(keep, aux, q_len, kv_len, q_len, device)
    if not 0 < width < kv_len or q_len != kv_len:
        return None
    return width if _differences(keep, aux, q_len, kv_len, width, device)[0] == 0 else None


@dataclass(frozen=True)
class Decision:
    causal: bool
    sdpa_ms: float
    fused_ms: float
    measured_at: str  # the shape timed (`shape_named`)

    @property
    def runs_sdpa(self) -> bool:
        return self.sdpa_ms <= FASTER * self.fused_ms

    def describe(self, gradients: bool, where: str) -> str:
        """What ran at the shape `where`, and the times that decided it (taken at another shape of its class)."""
        ran = "SDPA ran" if self.runs_sdpa else "the fused kernels ran"
        passes = "forward and backward" if gradients else "forward"
        at = "" if where == self.measured_at else f" at {self.measured_at}"
        return (f"{ran} ({'causal' if self.causal else 'unmasked'}; {passes} measured{at} {self.sdpa_ms:.3g} ms in "
                f"SDPA, {self.fused_ms:.3g} ms fused)")


def shape_named(q: torch.Tensor) -> str:
    """`[B, H, N, D] dtype` of the queries: what the report names a decision by."""
    return f"[{', '.join(map(str, q.shape))}] {str(q.dtype).removeprefix('torch.')}"


def layout_class(x: torch.Tensor) -> tuple:
    """The layouts one timing decides for: batch and length rounded up to a power of two (a new length under
    symbolic sizes is not timed again, and both ways' times grow alike within a class), heads and head dim as
    they are, the dims' order in memory and which are broadcast."""
    b, h, n, d = x.shape
    order = tuple(sorted(range(4), key=lambda i: -x.stride(i)))
    return triton.next_power_of_2(b), h, triton.next_power_of_2(n), d, order, tuple(s == 0 for s in x.stride())


# Per class of layouts (`layout_class`), mask functions, dtype, device and gradients.
_decisions: dict[tuple, Decision] = {}
_deciding = threading.Lock()


def decision(key: tuple, decide: Callable[[], Decision]) -> Decision:
    """The decision for `key`, made once."""
    if key not in _decisions:
        with _deciding:
            if key not in _decisions:
                _decisions[key] = decide()
    return _decisions[key]


def can_time(device: torch.device) -> bool:
    """Whether times taken on `device` decide anything (the interpreter's do not)."""
    return device.type == "cuda"


class _InABackward(torch.autograd.Function):
    """Runs a function inside autograd's backward on a device's thread, as the op's backward runs there: SDPA's kept
    graph is then differentiated from inside another backward (re-entrantly), which costs host time of its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[], object]) -> torch.Tensor:
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.fn()
        return grad, None


def in_a_backward(fn: Callable[[], object], device: torch.device) -> None:
    """`fn` run as a backward on `device` runs: inside autograd's backward."""
    with autograd_enabled():
        _InABackward.apply(torch.zeros((), device=device, requires_grad=True), fn).backward()


def timed(sdpa_step: Callable[[], object], fused_step: Callable[[], object]) -> tuple[float, float]:
    """(SDPA's ms, the fused kernels' ms): medians on the running GPU."""
    return median_ms(sdpa_step, warmup=10, rep=50), median_ms(fused_step, warmup=10, rep=50)


@dataclass(frozen=True)
class SdpaRun:
    """The op's forward and backward through SDPA, laid out as the fused kernels' (`out_strides`: the output's)."""

    form: SdpaForm
    causal: bool

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                                scale=self.form.scale, enable_gqa=self.form.gqa)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_strides: tuple[int, ...],
                token: torch.Tensor, gradients: bool) -> torch.Tensor:
        """The output; where `gradients`, SDPA's autograd graph kept under `token`'s storage."""
        if not gradients:
            return with_strides(self.attend(q, k, v), out_strides)
        with autograd_enabled():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = self.attend(*inputs)
        keep_forward(token, (inputs, out))
        return with_strides(out.detach(), out_strides)

    @staticmethod
    def backward(grad_out: torch.Tensor, token: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> None:
        """Writes the gradients of the forward kept under `token` into `grads` (views laid out as Q, K, V's
        sources). The graph is retained: a second backward through one forward reads it again."""
        inputs, out = kept_forward(token)
        with autograd_enabled():
            found = torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
        for into, g in zip(grads, found):
            into.copy_(g)

    @staticmethod
    def ran(token: torch.Tensor) -> bool:
        """Whether the forward that returned `token` ran SDPA."""
        return kept_forward(token) is not None
