"""The causal forward at B2 H16 N8192 D128, timed in turns: fusepass's compiled call of the hand-written code, its
flash kernel launched alone (``flash_attention_forward``, no compile step, the sweep's score functions), SDPA and
FlexAttention. Says how much of the call's time against SDPA is the kernel's, and how much the rest of the call
(its outputs' allocation, the replayed launch), where the suite's rows and the sweep's disagree.

    PYTHONPATH=. python bench/call_and_kernel.py [--rounds 5] [--case causal]

Each round times every variant once (``do_bench`` medians); the table gives each round's milliseconds and their
median, and the ratios of the medians.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from attention import CASES, SHAPES, setup
from flash_sweep import CAUSAL_LINEAR, PLAIN_LINEAR
from harness import keep, median_ms

from fusepass.kernels.flash_fwd import flash_attention_forward

KERNEL_MODS = {"causal": CAUSAL_LINEAR, "plain": PLAIN_LINEAR}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--case", choices=sorted(KERNEL_MODS), default="causal")
    args = parser.parse_args()
    cased = setup(CASES[args.case], SHAPES["large"], {"sdpa"}, backward=False)
    q, k, v = cased.wrt[:3]
    mod = KERNEL_MODS[args.case]
    variants = {"fusepass call": cased.step("fusepass", False), "kernel alone": lambda: flash_attention_forward(
        q, k, v, mod, ())[0], "sdpa": cased.step("sdpa", False), "flex": cased.step("flex", False)}
    for call in variants.values():  # compile, build maps, capture the replayed launches
        for _ in range(3):
            call()
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


if __name__ == "__main__":
    main()
