"""Attention, side by side: the hand-written code in eager, under Inductor and under fusepass, against
``F.scaled_dot_product_attention`` and FlexAttention given the same mask or bias.

    PYTHONPATH=. python bench/attention.py [--cases causal,alibi] [--shapes small,large]

TFLOP/s count only the unmasked work (4·B·H·Nq·Nk·D per forward, × 2.5 for forward+backward).

"error vs peer" is the distance of fusepass's output from the peer's (SDPA's, else FlexAttention's), not from
float64: with a backward in half precision fusepass cuts its weights toward zero (docs/flash-kernel-interface.md)
where the peers round them, so the two carry different roundings, each about as far from float64
(`bench/gradient_accuracy.py` measures that).

Shapes are B, H, N, D and the kv heads: with fewer kv heads than query heads (GQA) the hand-written code
repeats k and v for each query head (``repeat_interleave``), SDPA is given the repeated k and v as well, and
FlexAttention reads the kv heads as they are (``enable_gqa``). ``odd`` is the large shape one position short,
a length no tile divides; ``bert`` is BERT-base's attention as `bench/models.py` trains it.

FlexAttention's block mask is built once, outside the timed calls. Where the mask reads the call's inputs (padding
lengths, document ids: fusepass maps it inside every call), the peer ``flex-mask`` (``--peers sdpa,flex,flex-mask``)
times FlexAttention with its block mask built in each call, as a training step with new inputs builds it (by
``create_block_mask`` compiled, over the batch and broadcast over the heads).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from harness import keep, median_ms, peak_memory_gib, relative_error
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusepass
from fusepass.report.records import SDPA

WINDOW = 1024
SHAPES = {"small": (8, 16, 2048, 64, 16), "large": (2, 16, 8192, 128, 16), "d96": (2, 16, 8192, 96, 16),
          "gqa": (2, 16, 8192, 128, 4), "odd": (2, 16, 8191, 128, 16),
          "bert": (8, 12, 512, 64, 12)}  # BERT-base's, as bench/models.py trains it


def kv_repeated(fn: Callable | None, group: int) -> Callable | None:
    """`fn` of (q, k, v, *extra) given k and v with one head per `group` query heads, as GQA code writes it."""
    if fn is None or group == 1:
        return fn
    return lambda q, k, v, *extra: fn(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                      *extra)


def slopes(heads: int, device: str) -> torch.Tensor:
    return torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device=device)


# The hand-written attention of each case: what users write, what eager, Inductor and fusepass run.

def plain(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def causal(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


class BufferCausal(torch.nn.Module):
    """nanoGPT's causal mask: a float ``tril`` buffer of the longest length, sliced and compared with 0."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.ones(1, 1, 0, 0))

    def forward(self, q, k, v):
        n = q.shape[-2]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


BUFFER_CAUSAL = BufferCausal()


def buffer_of_length(b, h, n, device):
    """The buffer of `BUFFER_CAUSAL` at the case's length, on its device (as a model's block size): no input."""
    BUFFER_CAUSAL.bias = torch.ones(n, n, device=device).tril().view(1, 1, n, n)
    return ()


def sliding_window(q, k, v):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    distance = i[:, None] - i[None, :]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill((distance < 0) | (distance >= WINDOW), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def alibi_causal(q, k, v, m):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    bias = m[:, None, None] * (i[None, None, :] - i[None, :, None])
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    s = s.masked_fill(i[None, :, None] < i[None, None, :], float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def t5_bucket(relative: torch.Tensor) -> torch.Tensor:
    buckets = (relative > 0).to(torch.long) * 16
    distance = relative.abs()
    large = 8 + (torch.log(distance.float().clamp(min=1) / 8) / math.log(128 / 8) * 8).to(torch.long)
    return buckets + torch.where(distance < 8, distance, large.clamp(max=15))


def t5_bias(q, k, v, table):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    bias = F.embedding(t5_bucket(i[None, :] - i[:, None]), table).permute(2, 0, 1)
    s = q @ k.transpose(-1, -2) + bias
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def softcap_causal(q, k, v):
    n = q.shape[-2]
    s = torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) / 20.0) * 20.0
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def padding(q, k, v, lengths):
    n = q.shape[-2]
    keep = torch.arange(n, device=q.device)[None, :] < lengths[:, None]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def document(q, k, v, segments):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(segments[:, None, :, None] != segments[:, None, None, :], float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def packed_causal(q, k, v, segments):
    """Documents packed into one sequence for causal language modelling."""
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    same = segments[:, None, :, None] == segments[:, None, None, :]
    s = s.masked_fill(~(same & causal), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


@dataclass
class Case:
    name: str
    fn: Callable
    extra: Callable  # (B, H, N, device) -> extra inputs
    sdpa: Callable | None  # (q, k, v, *extra) -> output, or None where SDPA cannot say it
    flex: Callable  # (B, H, N, *extra) -> (score_mod, mask_mod)
    density: Callable  # (N) -> fraction of (q, k) pairs computed
    flex_scale: float | None = None  # FlexAttention's scale, where the code does not divide by sqrt(D)
    mask_reads_inputs: bool = False  # whether the mask reads the extra inputs (a step with new ones maps it anew)


def no_extra(b, h, n, device):
    return ()


def _causal_mask(b, h, q, kv):
    return q >= kv


CASES = {
    "plain": Case("plain", plain, no_extra, lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                  lambda b, h, n: (None, None), lambda n: 1.0),
    "causal": Case("causal", causal, no_extra,
                   lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   lambda b, h, n: (None, _causal_mask), lambda n: (n + 1) / (2 * n)),
    "causal_buffer": Case("causal, a buffer", BUFFER_CAUSAL, buffer_of_length,
                          lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          lambda b, h, n: (None, _causal_mask), lambda n: (n + 1) / (2 * n)),
    "window": Case(
        "sliding window 1024", sliding_window, no_extra,
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_window_dense(q.shape[-2], q.device)),
        lambda b, h, n: (None, lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW)),
        lambda n: min(1.0, (WINDOW * n - WINDOW * (WINDOW - 1) / 2) / (n * n))),
    "alibi": Case(
        "ALiBi + causal", alibi_causal, lambda b, h, n, device: (slopes(h, device),),
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=_alibi_dense(m, q.shape[-2])),
        lambda b, h, n, m: (lambda s, b, h, q, kv: s + m[h] * (kv - q), _causal_mask),
        lambda n: (n + 1) / (2 * n)),
    "t5": Case(
        "T5 bucketed bias", t5_bias,
        lambda b, h, n, device: (torch.randn(32, h, device=device, dtype=torch.bfloat16),), None,
        lambda b, h, n, table: (lambda s, b, h, q, kv: s + table[t5_bucket(kv - q), h], None), lambda n: 1.0,
        flex_scale=1.0),
    "t5_learnable": Case(
        "T5 bias, learnable table", t5_bias,
        lambda b, h, n, device: (torch.randn(32, h, device=device, dtype=torch.bfloat16, requires_grad=True),),
        None, lambda b, h, n, table: (lambda s, b, h, q, kv: s + table[t5_bucket(kv - q), h], None), lambda n: 1.0,
        flex_scale=1.0),
    "softcap": Case(
        "softcap + causal", softcap_causal, no_extra, None,
        lambda b, h, n: (lambda s, b, h, q, kv: torch.tanh(s / 20.0) * 20.0, _causal_mask),
        lambda n: (n + 1) / (2 * n)),
    "padding": Case(
        "padding mask", padding,
        lambda b, h, n, device: (torch.randint(n // 2, n + 1, (b,), device=device),),
        lambda q, k, v, lengths: F.scaled_dot_product_attention(
            q, k, v, attn_mask=(torch.arange(q.shape[-2], device=q.device)[None, :] < lengths[:, None])[:, None, None]),
        lambda b, h, n, lengths: (None, lambda b, h, q, kv: kv < lengths[b]), lambda n: 0.75,
        mask_reads_inputs=True),
    "document": Case(
        "document mask", document,
        lambda b, h, n, device: (torch.sort(torch.randint(0, 8, (b, n), device=device), dim=-1).values,), None,
        lambda b, h, n, seg: (None, lambda b, h, q, kv: seg[b, q] == seg[b, kv]), lambda n: 1 / 8,
        mask_reads_inputs=True),
    "packed": Case(
        "packed documents, causal", packed_causal,
        lambda b, h, n, device: (torch.sort(torch.randint(0, 8, (b, n), device=device), dim=-1).values,), None,
        lambda b, h, n, seg: (None, lambda b, h, q, kv: (seg[b, q] == seg[b, kv]) & (q >= kv)),
        lambda n: (n / 8 + 1) / (2 * n), mask_reads_inputs=True),
}


def _window_dense(n, device):
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < WINDOW)


def _alibi_dense(m, n):
    i = torch.arange(n, device=m.device)
    bias = m[:, None, None] * (i[None, None, :] - i[None, :, None]).to(m.dtype)
    return bias.masked_fill(i[:, None] < i[None, :], float("-inf")).to(torch.bfloat16)


def inputs(shape: tuple[int, ...], backward: bool, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """Fresh bf16 q, k, v of `shape` (k and v with its kv heads)."""
    b, h, n, d, kv_heads = shape
    return tuple(torch.randn(b, heads, n, d, device=device, dtype=torch.bfloat16, requires_grad=backward)
                 for heads in (h, kv_heads, kv_heads))


@dataclass
class Setup:
    """One case at one shape: each variant's forward call on the same fresh inputs, and what the backward
    differentiates."""

    variants: dict[str, Callable[[], torch.Tensor]]
    wrt: tuple[torch.Tensor, ...]  # q, k, v and every input that needs a gradient (a learnable bias table)
    grad: torch.Tensor

    def step(self, name: str, backward: bool) -> Callable[[], tuple[torch.Tensor, ...]]:
        """A variant's call, its output (and with `backward` the gradients of `wrt`) returned."""
        forward = self.variants[name]
        if not backward:
            return lambda: (forward(),)

        def forward_backward() -> tuple[torch.Tensor, ...]:
            out = forward()
            return (out, *torch.autograd.grad(out, self.wrt, self.grad))
        return forward_backward


def setup(case: Case, shape: tuple[int, ...], peers: set[str], backward: bool, flex: bool = True,
          device: str = "cuda") -> Setup:
    """fusepass on `case`, FlexAttention unless told, and those of eager, inductor and sdpa `peers` names (SDPA
    where it can say the case)."""
    b, h, n, d, kv_heads = shape
    q, k, v = inputs(shape, backward, device)
    written, sdpa = kv_repeated(case.fn, h // kv_heads), kv_repeated(case.sdpa, h // kv_heads)
    extra = case.extra(b, h, n, device)
    variants: dict[str, Callable] = {}
    if "eager" in peers:
        variants["eager"] = lambda: written(q, k, v, *extra)
    if "inductor" in peers:
        inductor = torch.compile(written, backend="inductor")
        variants["inductor"] = lambda: inductor(q, k, v, *extra)
    # no silent fallback; the fused kernels themselves, not SDPA where it is faster (the peer "floor": with it)
    fused = torch.compile(written, backend=fusepass.backend(strict=True, sdpa=False, graphs=False))
    variants["fusepass"] = lambda: fused(q, k, v, *extra)
    if "floor" in peers:
        floored = torch.compile(written, backend=fusepass.backend(strict=True, graphs=False))
        variants["floor"] = lambda: floored(q, k, v, *extra)
    if sdpa is not None and "sdpa" in peers:
        variants["sdpa"] = lambda: sdpa(q, k, v, *extra)
    if flex:
        score_mod, mask_mod = case.flex(b, h, n, *extra)
        block_mask = create_block_mask(mask_mod, b, h, n, n, device=device) if mask_mod else None
        compiled_flex = torch.compile(flex_attention)
        variants["flex"] = lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                 scale=case.flex_scale, enable_gqa=kv_heads != h)
        if "flex-mask" in peers and case.mask_reads_inputs:
            variants["flex-mask"] = lambda: compiled_flex(
                q, k, v, score_mod=score_mod, scale=case.flex_scale, enable_gqa=kv_heads != h,
                block_mask=create_block_mask(mask_mod, b, None, n, n, device=device, _compile=True))
    wrt = (q, k, v, *[x for x in extra if isinstance(x, torch.Tensor) and x.requires_grad])
    return Setup(variants, wrt, torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16))


def fusepass_call(case: Case, backward: bool, shape: tuple[int, ...] = SHAPES["large"], device: str = "cuda"
                  ) -> tuple[Callable[[], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """One call of `case` compiled by fusepass on fresh bf16 inputs of `shape` (forward, or forward and
    backward), warmed up; and its (q, k, v)."""
    call = (cased := setup(case, shape, set(), backward, flex=False, device=device)).step("fusepass", backward)
    for _ in range(3):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    return call, cased.wrt[:3]


def run(case: Case, shape: tuple[int, ...], peers: set[str], backward: bool) -> dict:
    b, h, n, d, kv_heads = shape
    cased = setup(case, shape, peers, backward)
    variants = cased.variants
    error = relative_error(variants["fusepass"](), variants["sdpa" if "sdpa" in variants else "flex"]())
    report = fusepass.last_report()
    rewritten = any(r.kind == "attention" for r in report.rewrites) if report else False

    flops = 4 * b * h * n * n * d * case.density(n) * (2.5 if backward else 1.0)
    shape_name = f"B{b} H{h} N{n} D{d}" + (f" KV{kv_heads}" if kv_heads != h else "")
    row = {"case": case.name, "shape": shape_name, "pass": "fwd+bwd" if backward else "fwd",
           "rewritten": rewritten, "error vs peer": error}
    for name in variants:
        ms = median_ms(cased.step(name, backward))
        row[f"{name} ms"] = ms
        row[f"{name} TFLOP/s"] = flops / ms / 1e9
        if backward:
            row[f"{name} GiB"] = peak_memory_gib(cased.step(name, backward))
    # The timed calls replay their launches as CUDA graphs (fusepass.runtime.replay): one more, outputs and
    # gradients against the peer's, says what they computed.
    peer = "sdpa" if "sdpa" in variants else "flex"
    row["error of a later call"] = max(relative_error(got, expected) for got, expected in
                                       zip(cased.step("fusepass", backward)(), cased.step(peer, backward)()))
    row["vs flex"] = row["flex ms"] / row["fusepass ms"]
    if "flex-mask ms" in row:
        row["vs flex-mask"] = row["flex-mask ms"] / row["fusepass ms"]
    if "sdpa ms" in row:
        row["vs sdpa"] = row["sdpa ms"] / row["fusepass ms"]
    if "inductor ms" in row:
        row["vs inductor"] = row["inductor ms"] / row["fusepass ms"]
    if "floor ms" in row and "sdpa ms" in row:
        row["floor vs sdpa"] = row["sdpa ms"] / row["floor ms"]
        row["floor ran"] = " / ".join(sorted({ran for compiled in fusepass.reports() for r in compiled.rewrites
                                               for ran in r.detail.get(SDPA, {}).values()}))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--peers", default="sdpa,flex",
                        help="also: eager, inductor, flex-mask, floor (fusepass with SDPA where it times faster)")
    parser.add_argument("--no-backward", action="store_true")
    args = parser.parse_args()
    peers = set(args.peers.split(","))
    rows = []
    for shape_name in args.shapes.split(","):
        for name in args.cases.split(","):
            for backward in ((False,) if args.no_backward else (False, True)):
                fusepass.reset()
                torch._dynamo.reset()
                try:
                    row = run(CASES[name], SHAPES[shape_name], peers, backward)
                except Exception as error:  # one failing case is reported in its row, the suite goes on
                    row = {"case": CASES[name].name, "shape": shape_name, "pass": "fwd+bwd" if backward else "fwd",
                           "error": f"{type(error).__name__}: {str(error)[-300:]}"}
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    columns = ["case", "shape", "pass", "rewritten", "error vs peer", "error of a later call", "fusepass ms",
               "fusepass TFLOP/s", "flex ms", "sdpa ms", "inductor ms", "eager ms", "flex-mask ms", "vs flex",
               "vs sdpa", "vs inductor", "vs flex-mask", "floor ms", "floor vs sdpa", "floor ran", "fusepass GiB",
               "sdpa GiB", "flex GiB", "error"]
    print(keep("attention", [c for c in columns if any(c in r for r in rows)], rows))


if __name__ == "__main__":
    main()
