"""Where one call of a compiled attention spends its time, host and device (torch.profiler).

    PYTHONPATH=. python bench/host_trace.py [--cases document,causal]

Runs each case of ``bench/attention.py`` (B2 H16 N8192 D128 bf16) under fusepass, warm, then profiles five
forward calls and prints the ops with the most host time and the kernels with the most device time. Wall
time per call beside the device time of its kernels says how much of a call is launch overhead.
"""
from __future__ import annotations

import argparse
import time

import torch
from attention import CASES

import fusepass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="document,causal")
    args = parser.parse_args()
    for name in args.cases.split(","):
        case = CASES[name]
        b, h, n, d = 2, 16, 8192, 128
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        extra = case.extra(b, h, n, "cuda")
        fused = torch.compile(case.fn, backend=fusepass.backend(strict=True))
        for _ in range(3):
            fused(q, k, v, *extra)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fused(q, k, v, *extra)
        host_ms = (time.perf_counter() - start) / 20 * 1e3
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / 20 * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fused(q, k, v, *extra)
            torch.cuda.synchronize()
        print(f"== {name}: host {host_ms:.3f} ms per call to return, wall {wall_ms:.3f} ms per call")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
