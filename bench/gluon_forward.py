"""The sm_90 forward (`fusepass.flash.hopper_forward`, Gluon) beside fusepass's Triton forward and SDPA (cuDNN), or
its sm_90 build's counts offline:

    PYTHONPATH=. python bench/gluon_forward.py             (on the GPU machine: check against float64, then time)
    PYTHONPATH=DIR:. python bench/gluon_forward.py --sass  (any machine, DIR holding triton 3.6: the sm_90 build's
                                                            registers, barriers and wgmma waits)
    --rings 128,2;64,3   the kernel also at other K/V tiles and ring depths (BLOCK_N,STAGES each; the first is
                         `hopper_forward`'s own): timed beside it, or compiled with --sass; a third field 1 or 0:
                         a persistent grid or one program an item at any length (without: the kernel's own rule,
                         `hopper_forward.PERSISTENT_UP_TO`)

The variants measured before the kernel became fusepass's (one partition of two warpgroups, K/V tiles of 64 rows)
are in bench/results/gluon-forward-2026-12-05-1200.md; the kernel kept is the fastest of them.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile
from unittest import mock

import torch

from fusepass.flash import hopper_forward


def sdpa_form_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and lse on contiguous [B, H, N, D] tensors."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    hopper_forward.hopper_forward(q, k, v, out, lse, torch.empty_like(lse), None, 1 / math.sqrt(q.shape[3]), causal)
    return out, lse


def ring(block_n: int, stages: int, persistent: bool | None):
    """`hopper_forward` set to K/V tiles of `block_n` rows in a ring of `stages`, its grid `persistent` or not at any
    length (None: its own rule), restored on leaving."""
    settings = {} if persistent is None else {"PERSISTENT_UP_TO": 1 << 30 if persistent else 0}
    return mock.patch.multiple(hopper_forward, BLOCK_N=block_n, STAGES=stages, **settings)


def sm90_build(kernel) -> tuple[str, str]:
    """A kernel compiled for sm_90 (no GPU): its SASS, and what ptxas said of it (-v: registers, serializations)."""
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        notes = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o",
                                os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True).stdout
    return sass, notes


def sass_counts(causal: bool, head_dim: int, exact: bool) -> dict:
    """Registers, spills and the instructions that order the loop, from the sm_90 build (no GPU), at
    `hopper_forward`'s present ring; `exact`: the training forward's weights (`forward.keeps_residual`)."""
    from kernel_resources import CompileOnlyDriver, resources
    from triton.runtime import driver

    driver.set_active(CompileOnlyDriver())
    x = torch.empty(1, 1, 1024, head_dim, dtype=torch.bfloat16)
    hf = hopper_forward
    rows = (hf.BLOCK_M // hf.PARTS, hf.BLOCK_N, hf.BLOCK_N, hf.BLOCK_M // hf.PARTS, hf.BLOCK_M // hf.PARTS)
    described = [hf._Rows.of(x).described(x, n) for n in rows]  # Q, K, V, the output and its residual
    lse = torch.empty(1, 1, 1024)
    kernel = hf._hopper_forward.warmup(*described, lse, lse, lse, *[x.stride()[:3]] * 4, 1, 1, 1, 1024, 1024, 0.125,
                                       HEAD_DIM=head_dim, BLOCK_M=hf.BLOCK_M, BLOCK_N=hf.BLOCK_N, CAUSAL=causal,
                                       STAGES=hf.STAGES, EXACT=exact, UNIT=hf.item_unit(1024, causal),
                                       num_warps=4, grid=(1,))
    sass, notes = sm90_build(kernel)
    counts = {name: len(re.findall(name, sass)) for name in ("BAR.SYNC", "WARPGROUP.DEPBAR", "HGMMA", "MUFU.EX2")}
    serialized = re.findall(r"\(C75\d\d\)[^\n]*serialized due to ([^\n]*) in the function", notes)
    return {**resources(kernel), **counts, "wgmma serialized": "; ".join(serialized) or "no"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", action="store_true", help="the sm_90 build's counts, no GPU")
    parser.add_argument("--shapes", default="2,16,8192,128;8,16,2048,64")
    parser.add_argument("--rings", default=f"{hopper_forward.BLOCK_N},{hopper_forward.STAGES}")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]
    rings = [(*map(int, r.split(",")[:2]), None if len(r.split(",")) < 3 else r.split(",")[2] == "1")
             for r in args.rings.split(";")]
    if args.sass:
        for block_n, stages, persistent in rings:
            for causal in (True, False):
                for head_dim in sorted({s[3] for s in shapes}):
                    for exact in (False, True):
                        with ring(block_n, stages, persistent):
                            print(f"K/V {block_n} x {stages} persistent={persistent} causal={causal} exact={exact} "
                                  f"D{head_dim}:", sass_counts(causal, head_dim, exact))
        return
    import triton.testing
    from attention import CASES

    import fusepass
    print("| shape | case | kernel | error (float64) | SDPA bf16's | ms | TFLOP/s | vs SDPA | vs Triton |")
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

            fused = torch.compile(case.fn, backend=fusepass.backend(strict=True, sdpa=False, graphs=False))
            timed = {}
            for block_n, stages, persistent in rings:
                label = "sm_90 kernel" + ("" if (block_n, stages, persistent) == rings[0] else
                                          f" K/V {block_n} x {stages}" + {None: "", True: ", persistent",
                                                                          False: ", an item a program"}[persistent])

                def kernel(block_n=block_n, stages=stages, persistent=persistent, *tensors):
                    with ring(block_n, stages, persistent):
                        return sdpa_form_attention(*(tensors or (q, k, v)), causal)
                timed[label] = (kernel, distance(kernel(block_n, stages, persistent, *head)[0]))
            timed["SDPA"] = (lambda: case.sdpa(q, k, v), distance(case.sdpa(*head)))
            serves = hopper_forward.serves
            hopper_forward.serves = lambda *_: False  # fusepass's Triton forward
            try:
                timed["Triton"] = (lambda: fused(q, k, v), distance(fused(*head)))
                fused(q, k, v)
            finally:
                hopper_forward.serves = serves
            flops = 4 * b * h * n * n * d * case.density(n)
            ms = {label: triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                  for label, (fn, _) in timed.items()}
            for label, (_, error) in timed.items():
                print(f"| B{b} H{h} N{n} D{d} | {name} | {label} | {error:.2e} | {timed['SDPA'][1]:.2e} | "
                      f"{ms[label]:.3f} | {flops / ms[label] / 1e9:.0f} | {ms['SDPA'] / ms[label]:.3f} | "
                      f"{ms['Triton'] / ms[label]:.3f} |")
            del q, k, v


if __name__ == "__main__":
    main()
