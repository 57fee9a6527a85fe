"""Where one call of a compiled attention spends its time, host and device (torch.profiler).

    PYTHONPATH=. python bench/host_trace.py [--cases document,causal] [--backward] [--shape large]

Runs each case of ``bench/attention.py`` (at one of its shapes, B2 H16 N8192 D128 bf16 unless told) under
fusepass, warm, then profiles five calls (forward; with --backward, forward and backward) and prints the ops
with the most host time and the kernels with the most device time, the ops that synchronize with the device,
and the Python functions with the most host time. Wall time per call beside the device time of its kernels
says how much of a call is launch overhead.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import warnings

import torch
from attention import CASES, SHAPES, fusepass_call



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="document,causal")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--shape", default="large", choices=SHAPES)
    args = parser.parse_args()
    for name in args.cases.split(","):
        fused, _ = fusepass_call(CASES[name], args.backward, SHAPES[args.shape])
        start = time.perf_counter()
        for _ in range(20):
            fused()
        host_ms = (time.perf_counter() - start) / 20 * 1e3
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / 20 * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fused()
            torch.cuda.synchronize()
        print(f"== {name}: host {host_ms:.3f} ms per call to return, wall {wall_ms:.3f} ms per call")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
        # Host time close to wall time means a call waits for the device: name the op that synchronizes.
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused()
        torch.cuda.set_sync_debug_mode("default")
        for warning in caught:
            print(f"synchronizes: {warning.message} ({warning.filename}:{warning.lineno})")
        python = cProfile.Profile()
        python.runcall(lambda: [fused() for _ in range(20)])
        pstats.Stats(python).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
