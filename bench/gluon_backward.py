"""The sm_90 backward (`fusepass.flash.hopper_backward`, Gluon, one kernel) beside fusepass's Triton backward (two
kernels) and SDPA's (cuDNN's), after the sm_90 forward's training form (its exact weights and residual); on a sliding
window of 1024 keys (`hopper_backward.WINDOWS`), on the attention suite's padding (each batch's keys past a length
drawn from [N/2, N] masked: `hopper_backward.KEY_MASKS`) and on its documents (ids from 8 drawn per token, in order:
`hopper_backward.DOCUMENTS`), alone and packed for causal training, after the Triton forward's, beside the Triton
backward, each also by its kernels' device time alone (where the host is slower, do_bench's time is the host's); or
its sm_90 build's counts offline:

    PYTHONPATH=. python bench/gluon_backward.py             (on the GPU machine: gradients against float64, then time)
    PYTHONPATH=DIR:. python bench/gluon_backward.py --sass  (any machine, DIR holding triton 3.6: the sm_90 build's
                                                             registers, spills, barriers and TMA reductions)
"""
from __future__ import annotations

import argparse
import math
import re

import flash_sweep
import torch
import triton
import triton.language as tl
import triton.testing

from fusepass.attention.key_mask import kept_keys
from fusepass.flash import hopper_backward, hopper_forward
from fusepass.flash.blockmap import block_map_for
from fusepass.flash.forward import LOG2E
from fusepass.flash.score_mod import ScoreMod, SeparableKeep

SHAPES = "2,16,8192,128;8,16,2048,64"


@triton.jit
def scaled(s, b, h, q_idx, kv_idx, aux):
    return s * aux[0]  # aux: (the scale,)


@triton.jit
def scaled_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    return ds * aux[0]


# The Triton backward's score functions, the scale an argument
PLAIN = ScoreMod(name="gluon_backward_plain", score=scaled, score_grad=scaled_grad)
CAUSAL = ScoreMod(name="gluon_backward_causal", score=scaled, score_grad=scaled_grad, keep=flash_sweep.CAUSAL.keep,
                  fill=flash_sweep.CAUSAL.fill)
WINDOW_KEYS = 1024  # the attention suite's window


def window_mod(head_dim: int) -> ScoreMod:
    """The window as the attention pass lifts it, its scale declared (`ScoreMod.linear_scale`): the form the sm_90
    backward is served after."""
    return ScoreMod(name=f"gluon_backward_window_d{head_dim}", score=scaled, score_grad=scaled_grad,
                    keep=flash_sweep.window_1024_keep, fill=flash_sweep.CAUSAL.fill,
                    linear_scale=1 / math.sqrt(head_dim))


@triton.jit
def padding_keep(b, h, q_idx, kv_idx, aux):
    return kv_idx < tl.load(aux[1] + b)  # aux: (the scale, each batch's length, the length)


def padding_mod(head_dim: int) -> ScoreMod:
    """The suite's padding as the attention pass lifts it, its scale declared."""
    return ScoreMod(name=f"gluon_backward_padding_d{head_dim}", score=scaled, score_grad=scaled_grad,
                    keep=padding_keep, fill=flash_sweep.CAUSAL.fill, keep_uses_batch=True, keep_reads_aux=True,
                    linear_scale=1 / math.sqrt(head_dim))


@triton.jit
def document_rows(b, h, q_idx, aux):
    return tl.load(aux[1] + b * aux[2] + q_idx)  # aux: (the scale, the ids, the length)


@triton.jit
def document_cols(b, h, kv_idx, aux):
    return tl.load(aux[1] + b * aux[2] + kv_idx)


@triton.jit
def document_keep(b, h, q_idx, kv_idx, aux):
    return document_rows(b, h, q_idx, aux) == document_cols(b, h, kv_idx, aux)


@triton.jit
def packed_keep(b, h, q_idx, kv_idx, aux):
    return document_keep(b, h, q_idx, kv_idx, aux) & (q_idx >= kv_idx)


def document_mod(head_dim: int, causal: bool = False) -> ScoreMod:
    """The suite's documents as the attention pass lifts them, its scale declared; `causal`: packed for causal
    training (the ids' mask joined with the causal one)."""
    return ScoreMod(name=f"gluon_backward_{'packed' if causal else 'document'}_d{head_dim}", score=scaled,
                    score_grad=scaled_grad, keep=packed_keep if causal else document_keep, fill=flash_sweep.CAUSAL.fill,
                    keep_uses_batch=True, keep_reads_aux=True,
                    separable_keep=SeparableKeep(True, document_rows, document_cols,
                                                 flash_sweep.CAUSAL if causal else None),
                    linear_scale=1 / math.sqrt(head_dim))


CASES = ("causal", "plain", "window", "padding", "document", "packed")
AFTER_TRITON = ("window", "padding", "document", "packed")  # the cases whose forward is the Triton kernel's
LISTED = ("document", "packed")  # the cases of document ids


def sass_counts(case: str, head_dim: int) -> dict:
    """Registers, spills, and the instructions that order the loop and add dQ, from the sm_90 build (no GPU)."""
    from gluon_forward import sm90_build
    from kernel_resources import CompileOnlyDriver, resources
    from triton.runtime import driver

    driver.set_active(CompileOnlyDriver())
    hb = hopper_backward
    x = torch.empty(1, 1, 1024, head_dim, dtype=torch.bfloat16)
    described = [hopper_forward._Rows.of(x).described(x, n) for n in (hb.BLOCK_M, hb.BLOCK_M, hb.BLOCK_N // 2,
                                                                        hb.BLOCK_N // 2)]
    listed = case in LISTED
    n_stats = hb.STATS_WITH_IDS if listed else hb.STATS
    fp32 = hb.fp32_described(torch.empty(n_stats, 1024), torch.empty(1024, head_dim), n_stats)
    count, index = torch.empty(16, dtype=torch.int32), torch.empty(128, dtype=torch.int32)
    lists = (count, index, 8, 0, 16, 8, torch.empty(1, dtype=torch.int8)) if listed else (None,) * 7
    kernel = hb._hopper_backward.warmup(*described, *fp32, x, x,
                                        *[torch.empty(1, 1024, dtype=torch.int8) if case == "padding" else None] * 2,
                                        torch.empty(1, 1024, dtype=torch.int64) if listed else None, lists,
                                        *[x.stride()[:3]] * 4, x.stride(), x.stride(), 1024, 1, 1, 1024,
                                        WINDOW_KEYS, 0.125, 0.125 * LOG2E.value, HEAD_DIM=head_dim,
                                        BLOCK_M=hb.BLOCK_M, BLOCK_N=hb.BLOCK_N, CAUSAL=case in ("causal", "window", "packed"),
                                        STAGES=hb.STAGES, WINDOWED=case == "window", KEYED=case == "padding",
                                        LISTED=listed, ID_EQUAL=True, num_warps=4, grid=(1,))
    sass, notes = sm90_build(kernel)
    counts = {name: len(re.findall(name, sass)) for name in ("BAR.SYNC", "WARPGROUP.DEPBAR", "HGMMA", "MUFU.EX2",
                                                             "REDG", "UBLKRED|UTMAREDG")}
    serialized = re.findall(r"\(C75\d\d\)[^\n]*serialized due to ([^\n]*) in the function", notes)
    return {**resources(kernel), **counts, "wgmma serialized": "; ".join(serialized) or "no"}


def triton_mod(case: str, head_dim: int) -> ScoreMod:
    """The Triton kernels' score functions of `case`."""
    return {"causal": CAUSAL, "plain": PLAIN, "window": window_mod(head_dim), "padding": padding_mod(head_dim),
            "document": document_mod(head_dim), "packed": document_mod(head_dim, causal=True)}[case]


def training_forward(q, k, v, case, aux):
    """The forward as a training step runs it: out, lse and the backward's extra (log_sum, the output's rounding
    residual): the sm_90 forward's, or the Triton forward's for the window and padding (`aux` its score functions')."""
    from fusepass.flash.forward import FlashForwardExtra, flash_attention_forward, forward_outputs

    scale = 1 / math.sqrt(q.shape[3])
    if case in AFTER_TRITON:
        mod = triton_mod(case, q.shape[3])
        out, lse, extra = flash_attention_forward(q, k, v, mod, aux,
                                                  outputs=forward_outputs(q, mod, q.dtype, q.device, backward=True))
        return out, lse, extra
    out, residual = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    log_sum = torch.empty_like(lse)
    hopper_forward.hopper_forward(q, k, v, out, lse, log_sum, None, scale, case == "causal", residual)
    fallback = torch.zeros(q.shape[:3], device=q.device, dtype=torch.int8) if case == "causal" else None  # none
    return out, lse, FlashForwardExtra(log_sum, fallback, None, residual)


def backwards(q, k, v, do, case, mask_input):
    """{label: a call writing (dq, dk, dv) into new tensors} for the sm_90 backward, the Triton backward (both after the
    same training forward) and, but after the Triton forward, SDPA's backward (after its own forward). `mask_input`:
    padding's lengths (each batch's keys kept), the documents' ids."""
    from fusepass.flash.backward import flash_attention_backward

    scale = 1 / math.sqrt(q.shape[3])
    aux = (scale, mask_input, q.shape[2])
    out, lse, extra = training_forward(q, k, v, case, aux)
    mod = triton_mod(case, q.shape[3])
    window = WINDOW_KEYS if case == "window" else None

    def grads():
        return tuple(torch.empty_like(t) for t in (q, k, v))

    def sm90():
        g = grads()
        # padding's keep per key, as a compiled call's backward takes it
        kept = kept_keys(mod.keep, aux, q.shape[0], k.shape[2], hopper_backward.BLOCK_N, q.device) \
            if case == "padding" else None
        documents = None
        if case in LISTED:  # (the ids' own tensor for both sides: `document_ids` copies them)
            tiles = hopper_backward.BLOCK_M, hopper_backward.BLOCK_N
            documents = hopper_backward.DocumentIds(
                mask_input, mask_input, True, block_map_for(mod, aux, *q.shape[:3], k.shape[2], *tiles, q.device),
                extra.fallback_rows.amax(-1))
        hopper_backward.hopper_backward(do, q, k, v, out, lse, extra.log_sum, scale, case in ("causal", "window", "packed"), g,
                                        extra.residual, window, kept, documents)
        return g

    def triton_backward():
        g = grads()
        flash_attention_backward(do, q, k, v, out, lse, extra, mod, aux, None, grads=g)
        return g

    kernels = {"sm_90 kernel": sm90}
    if case in AFTER_TRITON:
        return {**kernels, "Triton": triton_backward}
    causal = case == "causal"
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                                                enable_gqa=group > 1)

    def sdpa():
        return torch.autograd.grad(sdpa_out, (qs, ks, vs), do, retain_graph=True)
    return {**kernels, "Triton": triton_backward, "SDPA": sdpa}


def reference(q, k, v, do, case, mask_input):
    """(dq, dk, dv) in float64."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[3])
    if case in ("causal", "window", "packed"):
        i = torch.arange(s.shape[-1], device=s.device)
        past = i[None, :] > i[:, None]
        if case == "window":
            past |= i[:, None] - i[None, :] >= WINDOW_KEYS
        s = s.masked_fill(past, float("-inf"))
    if case == "padding":
        i = torch.arange(s.shape[-1], device=s.device)
        s = s.masked_fill((i[None, :] >= mask_input[:, None])[:, None, None, :], float("-inf"))
    if case in LISTED:
        s = s.masked_fill(mask_input[:, None, :, None] != mask_input[:, None, None, :], float("-inf"))
    out = torch.softmax(s, -1) @ v64.repeat_interleave(group, 1)
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


def mask_input(case: str, batch: int, n: int) -> torch.Tensor | None:
    """What `case`'s mask reads, as the attention suite draws it: padding's lengths, the documents' ids."""
    if case == "padding":
        return torch.randint(n // 2, n + 1, (batch,), device="cuda")
    if case in LISTED:
        return torch.sort(torch.randint(0, 8, (batch, n), device="cuda"), dim=-1).values
    return None


def scores_kept(case: str, n: int, mask_input: torch.Tensor | None) -> float:
    """The scores a head computes at length n, on average over the batch: all, the causal half, the window's band,
    the keys padding keeps, or the pairs of one document (packed: the causal half of those)."""
    if case in ("plain", "causal"):
        return n * n if case == "plain" else n * (n + 1) / 2
    if case == "window":
        return WINDOW_KEYS * n - WINDOW_KEYS * (WINDOW_KEYS - 1) / 2
    batch = mask_input.shape[0]
    if case == "padding":
        return n * mask_input.sum().item() / batch
    pairs = (mask_input[:, :, None] == mask_input[:, None, :]).sum().item() / batch
    return pairs if case == "document" else (pairs + n) / 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", action="store_true", help="the sm_90 build's counts, no GPU")
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]
    if args.sass:
        for case in CASES:
            for head_dim in sorted({s[3] for s in shapes}):
                print(f"{case} D{head_dim}:", sass_counts(case, head_dim))
        return
    from harness import device_ms, environment
    env = environment()
    print(f"# gluon-backward\n\n{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}\n")
    torch.manual_seed(0)
    print("| shape | case | kernel | dq error | dk error | dv error | ms | kernels ms | TFLOP/s | vs SDPA "
          "| vs Triton |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, h, n, d in shapes:
        for case in CASES:
            # errors from float64 at B1 H4 (2 kv heads) N2048 (past the window), times at the shape
            small = [torch.randn(1, heads, 2048, d, device="cuda", dtype=torch.bfloat16) for heads in (4, 2, 2, 4)]
            small_mask = mask_input(case, 1, 2048)
            expected = reference(*small, case, small_mask)
            errors = {label: [((g.double() - e).norm() / e.norm()).item() for g, e in zip(fn(), expected)]
                      for label, fn in backwards(*small, case, small_mask).items()}
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            masked_by = mask_input(case, b, n)
            timed = backwards(q, k, v, do, case, masked_by)
            ms = {label: triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")
                  for label, fn in timed.items()}
            kernels = {label: device_ms(fn) for label, fn in timed.items()}
            kept = scores_kept(case, n, masked_by)
            flops = 2.5 * 4 * b * h * kept * d
            for label in timed:
                e = errors[label]
                versus_sdpa = f"{ms['SDPA'] / ms[label]:.3f}" if "SDPA" in ms else "—"
                print(f"| B{b} H{h} N{n} D{d} | {case} | {label} | {e[0]:.2e} | {e[1]:.2e} | {e[2]:.2e} | "
                      f"{ms[label]:.3f} | {kernels[label]:.3f} | {flops / ms[label] / 1e9:.0f} | {versus_sdpa} | "
                      f"{ms['Triton'] / ms[label]:.3f} |")
            del q, k, v, do, timed


if __name__ == "__main__":
    main()
