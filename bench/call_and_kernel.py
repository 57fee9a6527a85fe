"""The causal forward at B2 H16 N8192 D128, timed in turns: fusepass's compiled call of the hand-written code, its
flash kernel launched alone (``flash_attention_forward``, no compile step, the sweep's score functions) and
replayed from a CUDA graph, SDPA and FlexAttention. Says how much of the call's time against SDPA is the kernel's,
and how much the rest of the call (its outputs' allocation, the replayed launch), where the suite's rows and the
sweep's disagree.

    PYTHONPATH=. python bench/call_and_kernel.py [--rounds 5] [--case causal] [--trace]

Each round times every variant once (``do_bench`` medians); the table gives each round's milliseconds and their
median, and the ratios of the medians. With --trace, the GPU's work in one call of each variant after the rounds
(torch.profiler: each kernel's name and microseconds, and the span from the first kernel's start to the last's end).
"""
from __future__ import annotations

import argparse
import statistics

import torch
from attention import CASES, SHAPES, setup
from flash_sweep import CAUSAL_LINEAR, PLAIN_LINEAR
from harness import keep, median_ms

from fusepass.flash.forward import flash_attention_forward

KERNEL_MODS = {"causal": CAUSAL_LINEAR, "plain": PLAIN_LINEAR}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--case", choices=sorted(KERNEL_MODS), default="causal")
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args()
    cased = setup(CASES[args.case], SHAPES["large"], {"sdpa"}, backward=False)
    q, k, v = cased.wrt[:3]
    mod = KERNEL_MODS[args.case]
    variants = {"fusepass call": cased.step("fusepass", False), "kernel alone": lambda: flash_attention_forward(
        q, k, v, mod, ())[0], "sdpa": cased.step("sdpa", False), "flex": cased.step("flex", False)}
    for call in variants.values():  # compile, build maps, capture the replayed launches
        for _ in range(3):
            call()
    # The kernel alone again, replayed from a CUDA graph as the compiled call's launches are.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        variants["kernel alone"]()
    variants = {**variants, "kernel in a graph": graph.replay}
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, call in variants.items():
            times[name].append(median_ms(call))
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    rows = [{"variant": name, "median ms": medians[name], "rounds ms": " ".join(f"{t:.4f}" for t in ms),
             "sdpa / this": medians["sdpa"] / medians[name]} for name, ms in times.items()]
    print(keep(f"call-and-kernel-{args.case}", ["variant", "median ms", "sdpa / this", "rounds ms"], rows,
               notes=f"{args.case}, B2 H16 N8192 D128 bf16, forward; {args.rounds} rounds of do_bench medians, the "
                     "variants in turns within each round."))
    if args.trace:
        for name, call in variants.items():
            print(name, device_work(call))


def device_work(call) -> str:
    """The kernels one call runs on the GPU, with their µs, and the span they cover."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in trace.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not kernels:
        return "no kernels"
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    return f"span {span:.1f} µs: " + ", ".join(f"{e.name[:40]} {e.time_range.elapsed_us():.1f}" for e in kernels)


if __name__ == "__main__":
    main()
