"""Tile configs of the flash kernels, timed on causal attention (or unmasked, or documents packed for causal
language modelling, by --mask): what ``flash_config`` should choose.

    PYTHONPATH=. python bench/flash_sweep.py [--head-dim 128] [--head-dim-v 128] [--seq 8192] [--batch 2] [--heads 16]
        [--kv-heads 4] [--forward-only] [--chosen] [--mask causal|plain|window|packed|packed-bound|softcap|softcap-window]
        [--dkdv 32,64,4,3 64,64,4,3 ...]   (these dK/dV tiles beside flash_config's dQ tiles, no forward sweep)
        [--dkdv-apart]                     (each --dkdv config with dK and dV in launches of their own)
        [--dq 64,64,4,3 ...]               (these dQ tiles beside flash_config's dK/dV tiles, no forward sweep)
        [--forward 128,64,4,3 ...]         (these forward tiles, through descriptors, instead of the list below)
    A fifth number in a config groups its kernel's programs by (batch, head) pairs (FlashConfig.head_group;
    without one, flash_config.GPU_HEAD_GROUP).

Calls the kernels directly (no compile step), with score functions written here by hand. The packed mask
(the attention suite's ``packed`` case: 8 documents of random lengths per sequence) is mapped as the product
maps it, from each block's range of document ids (`ScoreMod.separable_keep`) joined with the causal map, in
every call, as a step with new ids does.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch
import triton
import triton.language as tl
from harness import keep, median_ms, relative_error

from fusepass.codegen import elementary
from fusepass.flash.score_mod import ScoreMod, SeparableKeep
from fusepass.flash import backward as flash_bwd, config as flash_config, forward as flash_fwd
from fusepass.flash.config import GPU_HEAD_GROUP, BackwardConfigs, FlashConfig


# 1/sqrt(128) at every head dim (the score functions spell it out: Triton reads no plain globals); the SDPA
# references are given the same scale.
SCALE = 0.08838834764831845


@triton.jit
def scaled(s, b, h, q_idx, kv_idx, aux):
    return s * 0.08838834764831845


@triton.jit
def scaled_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    return ds * 0.08838834764831845


@triton.jit
def causal_keep(b, h, q_idx, kv_idx, aux):
    return q_idx >= kv_idx


@triton.jit
def minus_inf(s, b, h, q_idx, kv_idx, aux):
    return tl.full(s.shape, float("-inf"), tl.float32)


@triton.jit
def document_id(b, h, idx, aux):
    # aux[0]: the document id of each position, [batch, seq] int64, aux[1] its batch stride
    return tl.load(aux[0] + b * aux[1] + idx)


@triton.jit
def packed_keep(b, h, q_idx, kv_idx, aux):
    return (document_id(b, h, q_idx, aux) == document_id(b, h, kv_idx, aux)) & (q_idx >= kv_idx)


@triton.jit
def softcapped(s, b, h, q_idx, kv_idx, aux):
    # Gemma 2's cap of 50 on the scaled scores, 50 · tanh(s · scale / 50), as the attention pass lifts it from a
    # bfloat16 chain (`codegen/elementary.py`'s tanh_within_bfloat16)
    return elementary.tanh_within_bfloat16(s * 0.08838834764831845 * 0.019999999552965164) * 50.0


@triton.jit
def softcapped_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    capped = elementary.tanh_within_bfloat16(s * 0.08838834764831845 * 0.019999999552965164)
    return ds * 50.0 * (1.0 - capped * capped) * 0.019999999552965164 * 0.08838834764831845


# A constant fill has no gradient function (fill_grad None), as the attention pass lifts one.
CAUSAL = ScoreMod(name="sweep_causal", score=scaled, score_grad=scaled_grad, keep=causal_keep, fill=minus_inf)
# The same, its scale declared (ScoreMod.linear_scale): full tiles fold it into the exponent.
CAUSAL_LINEAR = replace(CAUSAL, name="sweep_causal_linear", linear_scale=SCALE)
PLAIN = ScoreMod(name="sweep_plain", score=scaled, score_grad=scaled_grad)
PLAIN_LINEAR = replace(PLAIN, name="sweep_plain_linear", linear_scale=SCALE)
PACKED = replace(CAUSAL, name="sweep_packed", keep=packed_keep, keep_uses_batch=True, keep_reads_aux=True,
                 separable_keep=SeparableKeep(True, document_id, document_id, CAUSAL))
PACKED_LINEAR = replace(PACKED, name="sweep_packed_linear", linear_scale=SCALE)
# A bound, not a mask: the packed documents' map with KEEP the causal condition alone, what PARTIAL tiles would cost
# without the per-element compare of ids (its output is wrong wherever a PARTIAL tile is cut by a document's end).
PACKED_BOUND = replace(PACKED, name="sweep_packed_bound", keep=causal_keep)
@triton.jit
def window_keep(b, h, q_idx, kv_idx, aux):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 4096)


@triton.jit
def window_1024_keep(b, h, q_idx, kv_idx, aux):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)


# Gemma 2's global layers: causal, the scores capped (no scale to fold: its folded twin is itself). SDPA has no cap:
# its outputs are a reference for the timing only, the errors printed are the cap's.
SOFTCAP = replace(CAUSAL, name="sweep_softcap", score=softcapped, score_grad=softcapped_grad)
# Its local layers: the same in a causal window of 4096 keys.
SOFTCAP_WINDOW = replace(SOFTCAP, name="sweep_softcap_window", keep=window_keep)
# The attention suite's sliding window: causal, 1024 keys.
WINDOW = replace(CAUSAL, name="sweep_window", keep=window_1024_keep)
MASKS = {"causal": (CAUSAL, CAUSAL_LINEAR), "softcap": (SOFTCAP, SOFTCAP),
         "window": (WINDOW, replace(WINDOW, name="sweep_window_linear", linear_scale=SCALE)),
         "softcap-window": (SOFTCAP_WINDOW, SOFTCAP_WINDOW), "plain": (PLAIN, PLAIN_LINEAR),
         "packed": (PACKED, PACKED_LINEAR),
         "packed-bound": (PACKED_BOUND, replace(PACKED_BOUND, name="sweep_packed_bound_linear", linear_scale=SCALE))}

# Per-tile operands through TMA descriptors; the first config of each list also with pointer loads.
FORWARD = [FlashConfig(128, 128, 8, 3, descriptors=False)] + [
    FlashConfig(*tiles, descriptors=True) for tiles in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 2),
                                                         (128, 64, 8, 3), (128, 64, 8, 4))]
# dK/dV tiles are q chunk × kv block (block_m × block_n), laid out [kv, q]; dQ's q block × kv chunk.
BACKWARD = [BackwardConfigs(FlashConfig(32, 64, 4, 3), FlashConfig(128, 64, 8, 3))] + [
    BackwardConfigs(FlashConfig(*dkdv, descriptors=True), FlashConfig(*dq, descriptors=True)) for dkdv, dq in (
        ((32, 64, 4, 3), (128, 64, 8, 3)), ((32, 64, 4, 4), (128, 64, 8, 3)), ((64, 64, 4, 3), (128, 64, 8, 3)),
        ((16, 64, 4, 3), (128, 64, 8, 3)), ((32, 128, 8, 3), (128, 64, 8, 3)), ((32, 64, 4, 3), (128, 128, 8, 3)),
        ((32, 64, 4, 3), (64, 64, 4, 3)), ((32, 64, 4, 3), (128, 32, 8, 3)))]


def _config(tiles: str) -> FlashConfig:
    """A config from "block_m,block_n,num_warps,num_stages[,head_group]", through descriptors."""
    block_m, block_n, num_warps, num_stages, *head_group = map(int, tiles.split(","))
    return FlashConfig(block_m, block_n, num_warps, num_stages, descriptors=True,
                       head_group=(head_group or [GPU_HEAD_GROUP])[0])


def registers(kernel) -> str:
    """Registers per thread and spilled bytes of the kernel's most recent compile."""
    compiled = list(kernel.device_caches[torch.cuda.current_device()][0].values())[-1]
    return f"{compiled.n_regs} / {compiled.n_spills}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--head-dim-v", type=int, default=None,
                        help="V's head dim (latent attention: 128 at --head-dim 192); --head-dim's where not given")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="fewer kv heads than query heads: GQA")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--chosen", action="store_true", help="only the configs flash_config chooses")
    parser.add_argument("--dkdv", nargs="*", default=None,
                        help="block_m,block_n,num_warps,num_stages[,head_group] of dK/dV")
    parser.add_argument("--dkdv-apart", action="store_true",
                        help="each --dkdv config with dK and dV in launches of their own (BackwardConfigs.apart)")
    parser.add_argument("--dq", nargs="*", default=None, help="block_m,block_n,num_warps,num_stages[,head_group] of dQ")
    parser.add_argument("--forward", nargs="*", default=None,
                        help="block_m,block_n,num_warps,num_stages[,head_group] (tiles.grouped_program)")
    parser.add_argument("--mask", choices=MASKS, default="causal")
    args = parser.parse_args()
    chosen_forward = flash_fwd.forward_config  # flash_config's, before the sweep replaces it
    head_dim_v = args.head_dim_v or args.head_dim
    width = flash_config.tile_width(args.head_dim, head_dim_v)  # what the configs are chosen by
    masked = args.mask != "plain"
    mod, linear_mod = MASKS[args.mask]
    forward, backward = FORWARD, BACKWARD
    if args.chosen:  # flash_config's choices at this head dim (masks' tiles, unmasked ones for plain)
        cuda = torch.device("cuda")
        forward = [flash_fwd.forward_config(width, torch.bfloat16, masked, cuda)]
        backward = [flash_bwd.backward_configs(width, torch.bfloat16, masked, cuda)]
    if args.forward is not None:
        forward = [_config(c) for c in args.forward]
    swept_kernel = "" if args.forward is None else "-forward"
    for kernel in ("dkdv", "dq"):
        if getattr(args, kernel) is not None:
            swept_kernel = f"-{kernel}" + ("-apart" if kernel == "dkdv" and args.dkdv_apart else "")
            chosen = flash_bwd.backward_configs(width, torch.bfloat16, masked, torch.device("cuda"))
            apart = {"apart": args.dkdv_apart} if kernel == "dkdv" else {}
            forward, backward = [], [replace(chosen, **{kernel: _config(c)}, **apart) for c in getattr(args, kernel)]
    b, h, n, d = args.batch, args.heads, args.seq, args.head_dim
    kv_heads = args.kv_heads or h
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, kv_heads, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, kv_heads, n, head_dim_v, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(b, h, n, head_dim_v, device="cuda", dtype=torch.bfloat16)
    aux, sdpa_mask = (), {"is_causal": masked, "enable_gqa": kv_heads != h}
    if args.mask.startswith("packed"):
        ids = torch.sort(torch.randint(0, 8, (b, n), device="cuda"), dim=-1).values
        aux = (ids, ids.stride(0))
        sdpa_mask = {"attn_mask": ((ids[:, :, None] == ids[:, None, :]) &
                                   torch.ones(n, n, dtype=torch.bool, device="cuda").tril())[:, None],
                     "enable_gqa": kv_heads != h}
    if args.mask == "softcap-window":
        positions = torch.arange(n, device="cuda")
        distance = positions[:, None] - positions[None, :]
        sdpa_mask = {"attn_mask": (distance >= 0) & (distance < 4096), "enable_gqa": kv_heads != h}
    # SDPA's forward and backward under the packed mask (a dense one) are no peer: a reference only
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=SCALE, **sdpa_mask)
    density = {"causal": (n + 1) / (2 * n), "softcap": (n + 1) / (2 * n),
               "softcap-window": (4096 * (n - 4096) + 4096 * 4097 / 2) / n ** 2, "plain": 1,
               "packed": (n / 8 + 1) / (2 * n)}[args.mask.removesuffix("-bound")]
    flops = 2 * b * h * n * n * (d + head_dim_v) * density
    rows = []
    sdpa_ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=SCALE, **sdpa_mask))
    rows.append({"kernel": "sdpa forward", "config": "-", "ms": sdpa_ms, "TFLOP/s": flops / sdpa_ms / 1e9})
    out = lse = extra = None
    if args.forward is not None or args.chosen:
        folded = forward  # every given config, also with the scale folded
    else:
        folded = FORWARD[1:2] + FORWARD[4:5] if forward else []
    flash_fwd.narrow_kv_tiles = lambda config, wide_map: config  # each config at its own tiles
    for swept, config in [(mod, c) for c in forward] + [(linear_mod, c) for c in folded]:
        flash_fwd.forward_config = lambda *a, c=config: c
        kernel = "forward" if swept is mod else "forward, scale folded"
        try:
            out, lse, extra = flash_fwd.flash_attention_forward(q, k, v, swept, aux)
            error = relative_error(out, reference)
            ms = median_ms(lambda: flash_fwd.flash_attention_forward(q, k, v, swept, aux))
            rows.append({"kernel": kernel, "config": str(config), "ms": ms, "TFLOP/s": flops / ms / 1e9,
                         "error": error, "registers / spills": registers(flash_fwd._flash_forward_kernel)})
        except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
            rows.append({"kernel": kernel, "config": str(config), "ms": math.nan, "error": repr(e)[:60]})
        print(rows[-1], flush=True)
    # The backward follows a training forward at the tiles flash_config chooses: in half precision it keeps the exact
    # weights' statistics and its output's residual, which the backward kernels read (`forward.keeps_residual`).
    flash_fwd.forward_config = chosen_forward
    outputs = flash_fwd.forward_outputs(q, mod, None, q.device, backward=True, head_dim_v=head_dim_v)
    out, lse, extra = flash_fwd.flash_attention_forward(q, k, v, mod, aux, outputs=outputs)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, scale=SCALE, **sdpa_mask)
    sdpa_bwd = median_ms(lambda: torch.autograd.grad(sdpa_out, (qr, kr, vr), do, retain_graph=True))
    rows.append({"kernel": "sdpa backward", "config": "-", "ms": sdpa_bwd, "TFLOP/s": 2.5 * flops / sdpa_bwd / 1e9})
    expected = torch.autograd.grad(sdpa_out, (qr, kr, vr), do, retain_graph=True)
    for config in [] if args.forward_only else backward:
        flash_bwd.backward_configs = lambda *a, c=config: c
        try:
            grads = flash_bwd.flash_attention_backward(do, q, k, v, out, lse, extra, mod, aux, None)
            error = max(relative_error(g, e) for g, e in zip(grads, expected))
            ms = median_ms(lambda: flash_bwd.flash_attention_backward(do, q, k, v, out, lse, extra, mod, aux, None))
            rows.append({"kernel": "backward", "config": str(config), "ms": ms,
                         "TFLOP/s": 2.5 * flops / ms / 1e9, "error": error,
                         "registers / spills": ", ".join(registers(k) for k in (
                             flash_bwd._flash_backward_dkdv_kernel, flash_bwd._flash_backward_dq_kernel))})
        except Exception as e:
            rows.append({"kernel": "backward", "config": str(config), "ms": math.nan, "error": repr(e)[:60]})
        print(rows[-1], flush=True)
    name = (f"flash-sweep-d{d}" + ("" if head_dim_v == d else f"-dv{head_dim_v}") + f"-n{n}" +
            ("" if kv_heads == h else f"-kv{kv_heads}") +
            ("" if args.mask == "causal" else f"-{args.mask}") + swept_kernel)
    print(keep(name, ["kernel", "config", "ms", "TFLOP/s", "error", "registers / spills"], rows))


if __name__ == "__main__":
    main()
