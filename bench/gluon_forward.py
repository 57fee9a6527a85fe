"""A Gluon forward for plain and causal attention on sm_90, beside fusepass's Triton forward and SDPA (cuDNN):
whether warp specialization and products awaited by hand close the causal forward's gap to cuDNN (issue 34).

    PYTHONPATH=. python bench/gluon_forward.py             (on the GPU machine: check against float64, then time)
    PYTHONPATH=DIR:. python bench/gluon_forward.py --sass  (any machine, DIR holding triton 3.6: the sm_90 build's
                                                            registers, barriers and wgmma waits per variant)

Triton 3.6 waits for each tile's q·kᵀ right after issuing it and puts four CTA barriers in each tile of the loop
(NOTES "Next" 3). Here one warp loads Q, K and V by TMA into rings guarded by mbarriers; the warps that compute
issue tile j's scores, then tile j - 1's product with V, and take tile j's softmax while that product runs
(FlashAttention-3's order). Variants: the 128 query rows of a program in one partition of two warpgroups (in step)
or in two partitions of one warpgroup each (out of step: one's softmax beside the other's products); K and V tiles
of 128 or 64 rows.

A measurement, not a kernel fusepass calls: plain and causal only, lengths a multiple of 128, Q, K and V
contiguous [B, H, N, D] in bf16 or fp16.
"""
from __future__ import annotations

import argparse
import math
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


@gluon.jit
def _tile_weights(s, m_i, l_i, qk_scale, q_pos, k_pos, MASKED: gl.constexpr):
    """One tile's online softmax in base 2: its weights, the accumulator's rescale, the new row max and sum."""
    if MASKED:
        s = gl.where(q_pos[:, None] >= k_pos[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _load(desc, row, bar, dest, pred):
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, 0], bar, dest, pred=pred)


@gluon.jit
def _loads(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, done, q_row, head_row, n_tiles,
           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr):
    """The loading warp: Q once (a part for each partition that computes), then K and V a tile at a time into the
    next free buffer of their rings. `done[i]` completes each time every computing partition has read tile j's K and
    tile j - 1's V, for a j with j % STAGES == i."""
    for part in gl.static_range(PARTS):
        _load(q_desc, q_row + part * q_desc.block_type.shape[0], q_bars.index(part), q_smem.index(part), True)
    for j in range(n_tiles):
        slot = j % STAGES
        # A ring's buffers start free: the first wait on each is for the phase before its first.
        mbarrier.wait(done.index(slot), ((j // STAGES) & 1) ^ 1)
        _load(k_desc, head_row + j * BLOCK_N, k_ready.index(slot), k_smem.index(slot), True)
        # V[j] goes where V[j - STAGES] was, read by tile j - STAGES + 1 (≡ j + 1 modulo STAGES).
        mbarrier.wait(done.index((j + 1) % STAGES), ((j + 1 - STAGES) // STAGES) & 1, pred=j >= STAGES)
        _load(v_desc, head_row + j * BLOCK_N, v_ready.index(slot), v_smem.index(slot), True)


@gluon.jit
def _step(j, p_prev, alpha_prev, acc, m_i, l_i, qk_scale, q_pos, q_smem, k_smem, v_smem, k_ready, v_ready, done,
          S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          MASKED: gl.constexpr):
    """Tile j's scores, then tile j - 1's product with V beside tile j's softmax (FlashAttention-3's order: neither
    the accumulator nor the weights' registers are touched while a product that reads them runs)."""
    slot = j % STAGES
    before = (j + STAGES - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), gl.zeros([q_pos.shape[0], BLOCK_N], gl.float32,
                      S_LAYOUT), use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha_prev, gl.SliceLayout(1, O_LAYOUT))[:, None]
    mbarrier.wait(v_ready.index(before), ((j - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_prev, v_smem.index(before), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    k_pos = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    p, alpha, m_i, l_i = _tile_weights(s, m_i, l_i, qk_scale, q_pos, k_pos, MASKED)
    # The weights as a dependency of the wait: computed before it, not sunk past it to their use.
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(done.index(slot))  # K[j] and V[j - 1] read
    p = gl.convert_layout(p.to(v_smem.dtype), gl.DotOperandLayout(0, O_LAYOUT, 2))
    return p, alpha, acc, m_i, l_i


@gluon.jit
def _softmax_products(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, done, q_row, start_m,
                      n_tiles, qk_scale, part, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr):
    """A computing partition (one or two warpgroups, 64 query rows each): its `ROWS` rows' products and softmax."""
    warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_row = q_row + part * ROWS
    q_pos = start_m * BLOCK_M + part * ROWS + gl.arange(0, ROWS, layout=s_rows)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
    l_i = gl.zeros([ROWS], gl.float32, s_rows)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                      use_acc=False)
    mbarrier.arrive(done.index(0))
    # A causal program's masked tiles are its last BLOCK_M // BLOCK_N.
    n_full = n_tiles - BLOCK_M // BLOCK_N if CAUSAL else n_tiles
    k_pos = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    p, alpha, m_i, l_i = _tile_weights(s, m_i, l_i, qk_scale, q_pos, k_pos, CAUSAL)
    p = gl.convert_layout(p.to(v_smem.dtype), gl.DotOperandLayout(0, o_layout, 2))
    for j in range(1, n_full):
        p, alpha, acc, m_i, l_i = _step(j, p, alpha, acc, m_i, l_i, qk_scale, q_pos, q_smem, k_smem, v_smem, k_ready,
                                        v_ready, done, s_layout, o_layout, BLOCK_N, STAGES, False)
    for j in range(gl.maximum(n_full, 1), n_tiles):
        p, alpha, acc, m_i, l_i = _step(j, p, alpha, acc, m_i, l_i, qk_scale, q_pos, q_smem, k_smem, v_smem, k_ready,
                                        v_ready, done, s_layout, o_layout, BLOCK_N, STAGES, CAUSAL)
    last = n_tiles - 1
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc)

    acc = acc / gl.convert_layout(l_i, o_rows)[:, None]
    lse_layout: gl.constexpr = gl.BlockedLayout([1], [32], [warps], [0])
    lse = gl.convert_layout((m_i + gl.log2(l_i)) * 0.6931471805599453, lse_layout)  # base 2 to e: · ln 2
    gl.store(lse_ptr + q_row + gl.arange(0, ROWS, layout=lse_layout), lse)
    q_smem.store(acc.to(q_smem.dtype))  # Q is read no more: its buffer stages the output for one TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    tma.store_wait(0)


@gluon.jit
def _forward(q_desc, k_desc, v_desc, o_desc, lse_ptr, seq_len, qk_scale,
             HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
             STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """`SPLIT`: the program's query rows in two partitions of one warpgroup each, which run out of step (one's
    softmax beside the other's products); else one partition of two warpgroups."""
    dtype: gl.constexpr = q_desc.dtype
    PARTS: gl.constexpr = 2 if SPLIT else 1
    ROWS: gl.constexpr = BLOCK_M // PARTS
    # Causal: the longest rows first, so the short programs fill the last wave.
    start_m = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    head_row = gl.program_id(1) * seq_len
    q_row = head_row + start_m * BLOCK_M
    n_tiles = (start_m + 1) * (BLOCK_M // BLOCK_N) if CAUSAL else seq_len // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [PARTS, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [PARTS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(PARTS):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(done.index(i), count=PARTS)

    if SPLIT:
        gl.warp_specialize([
            (_softmax_products, (o_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, q_bars.index(0), k_ready,
                                 v_ready, done, q_row, start_m, n_tiles, qk_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                                 CAUSAL, STAGES, ROWS)),
            (_softmax_products, (o_desc, lse_ptr, q_smem.index(1), k_smem, v_smem, q_bars.index(1), k_ready,
                                 v_ready, done, q_row, start_m, n_tiles, qk_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N,
                                 CAUSAL, STAGES, ROWS)),
            (_loads, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, done, q_row,
                      head_row, n_tiles, BLOCK_N, STAGES, PARTS))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_softmax_products, (o_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, q_bars.index(0), k_ready,
                                 v_ready, done, q_row, start_m, n_tiles, qk_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                                 CAUSAL, STAGES, ROWS)),
            (_loads, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, done, q_row,
                      head_row, n_tiles, BLOCK_N, STAGES, PARTS))], [1], [24])


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
           block_m: int = 128, block_n: int = 128, stages: int = 2, split: bool = False, warmup: bool = False):
    """The kernel's launch (or, with `warmup`, its compile alone) on contiguous [B, H, N, D] q, k, v, out and
    [B, H, N] lse; N a multiple of `block_m`, itself one of `block_n`."""
    b, h, n, d = q.shape
    assert n % block_m == 0 and all(t.is_contiguous() for t in (q, k, v, out))
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def described(t: torch.Tensor, rows: int) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], dtype)
        return TensorDescriptor(t.view(b * h * n, d), [b * h * n, d], [d, 1], [rows, d], layout)

    rows = block_m // 2 if split else block_m
    args = (described(q, rows), described(k, block_n), described(v, block_n), described(out, rows), lse, n,
            LOG2E / math.sqrt(d))
    options = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, STAGES=stages,
                   SPLIT=split, num_warps=4 if split else 8)
    if warmup:
        return _forward.warmup(*args, **options, grid=(1,))
    return _forward[(n // block_m, b * h)](*args, **options)


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, **config
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / √D [causal]) v and each row's log-sum-exp."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    launch(q, k, v, out, lse, causal, **config)
    return out, lse


def sass_counts(causal: bool, head_dim: int, **config) -> dict:
    """Registers, spills and the instructions that order the loop, from the sm_90 build (no GPU)."""
    import re
    import subprocess
    import tempfile

    import triton
    from kernel_resources import CompileOnlyDriver, resources
    from triton.runtime import driver

    driver.set_active(CompileOnlyDriver())
    x = torch.empty(1, 1, 1024, head_dim, dtype=torch.bfloat16)
    kernel = launch(x, x, x, x, torch.empty(1, 1, 1024), causal, warmup=True, **config)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        notes = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o",
                                os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr
        cubin = os.path.join(tmp, "k.cubin")
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    counts = {name: len(re.findall(name, sass)) for name in ("BAR.SYNC", "WARPGROUP.DEPBAR", "HGMMA", "MUFU.EX2")}
    serialized = re.findall(r"\(C75\d\d\)[^\n]*serialized due to ([^\n]*) in the function", notes)
    return {**resources(kernel), **counts, "wgmma serialized": "; ".join(serialized) or "no"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", action="store_true", help="the sm_90 build's counts, no GPU")
    parser.add_argument("--shapes", default="2,16,8192,128;8,16,2048,64")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]
    if args.sass:
        for split in (False, True):
            for causal in (True, False):
                for head_dim in sorted({s[3] for s in shapes}):
                    print(f"split={split} causal={causal} D{head_dim}:", sass_counts(causal, head_dim, split=split))
        return
    import triton.testing
    from attention import CASES

    import fusepass
    variants = {"1 partition, 128x128": dict(), "2 partitions, 128x128": dict(split=True),
                "1 partition, 128x64": dict(block_n=64, stages=3),
                "2 partitions, 128x64": dict(block_n=64, stages=3, split=True)}
    print("| shape | case | kernel | error (float64) | SDPA bf16's | ms | TFLOP/s | vs SDPA | vs fusepass |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, h, n, d in shapes:
        for name in ("causal", "plain"):
            case, causal = CASES[name], name == "causal"
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            # the exact function in float64, on two heads
            head = tuple(t[:1, :2].contiguous() for t in (q, k, v))
            expected = case.sdpa(*(t.double() for t in head))

            def distance(got: torch.Tensor) -> float:
                return ((got.double() - expected).norm() / expected.norm()).item()

            fused = torch.compile(case.fn, backend=fusepass.backend(strict=True, sdpa=False))
            timed = {"fusepass (Triton)": (lambda: fused(q, k, v), distance(fused(*head))),
                     "SDPA": (lambda: case.sdpa(q, k, v), distance(case.sdpa(*head)))}
            for variant, config in variants.items():
                try:
                    timed[f"gluon, {variant}"] = (lambda config=config: gluon_attention(q, k, v, causal, **config),
                                                  distance(gluon_attention(*head, causal, **config)[0]))
                except Exception as error:  # a variant that does not build is a row, not the end of the run
                    print(f"| B{b} H{h} N{n} D{d} | {name} | gluon, {variant} | {type(error).__name__}: "
                          f"{str(error)[:150]} | | | | | |")
            flops = 4 * b * h * n * n * d * case.density(n)
            ms = {label: triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                  for label, (fn, _) in timed.items()}
            for label, (_, error) in timed.items():
                print(f"| B{b} H{h} N{n} D{d} | {name} | {label} | {error:.2e} | {timed['SDPA'][1]:.2e} | "
                      f"{ms[label]:.3f} | {flops / ms[label] / 1e9:.0f} | {ms['SDPA'] / ms[label]:.3f} | "
                      f"{ms['fusepass (Triton)'] / ms[label]:.3f} |")
            del q, k, v


if __name__ == "__main__":
    main()
