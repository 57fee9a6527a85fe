"""Host time of one compiled attention call, split into Triton launches (per kernel) and everything else.

    PYTHONPATH=. python bench/launch_cost.py [--cases window,document,causal] [--backward] [--profile] [--layers]
        [--floor] [--shape large]

Runs each case of ``bench/attention.py`` (at one of its shapes, B2 H16 N8192 D128 bf16 unless told) under
fusepass, warm, and times 20 calls on the host without waiting for the device (the launch queue is deep enough
not to block): per call, the host time to return, the time inside each kernel's launch
(``fusepass.runtime.launch.launch``: the signature lookup and the driver call, or Triton's binding and
specialization on a new signature) and the rest (the op's Python, torch's custom-op and autograd wrappers). A
call whose host time is above its device time leaves the GPU waiting. With --profile, the Python functions
with the most host time over those calls, by own time and by cumulative time. With --layers, the host time of
the attention op's forward and backward called through torch's dispatcher and as plain Python functions (what
the layers between them cost). With --floor, the host time of the same compiled call with the flash kernels'
functions returning one real call's results (no launch, no map: what Dynamo's guards, AOTAutograd, autograd
and the op's own wrapper cost), beside the host time of FlexAttention's compiled call on the same inputs.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time

import torch
from attention import CASES, SHAPES, fusepass_call, setup
from harness import keep

from fusepass.attention import call, op
from fusepass.flash import blockmap
from fusepass.flash import distance_table, config as flash_config
from fusepass.runtime import launch

CALLS = 20


def replace_attention_launches(replacement) -> None:
    """Launch every attention kernel (flash, block map, distance table) through `replacement`, called as
    ``launch.launch`` is."""
    for module in (flash_config, blockmap, distance_table):  # where attention kernels are launched
        module.launch = replacement


def timed_launches() -> collections.Counter:
    """Accumulate the host seconds of every Triton launch, by kernel name."""
    spent: collections.Counter = collections.Counter()

    def timed(kernel, *args, **kwargs):
        start = time.perf_counter()
        try:
            return launch.launch(kernel, *args, **kwargs)
        finally:
            spent[kernel.fn.__name__] += time.perf_counter() - start

    replace_attention_launches(timed)
    return spent


def host_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    spent = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return spent


def op_layers(q, k, v) -> dict:
    """Host µs of the newest attention op's forward and backward, through the dispatcher and as Python."""
    spec = list(call._calls)[-1]
    seed = torch.empty(0, dtype=torch.int64, device=q.device)
    detached = [t.detach() for t in (q, k, v)]
    out, lse, log_sum, fallback, residual, block_map = torch.ops.fusepass.attention(*detached, [], seed, spec)
    grad_out = torch.randn_like(out)
    backward_args = (grad_out, *detached, out, lse, log_sum, fallback, residual, block_map, [], seed, spec)
    return {"op fwd µs": host_us(lambda: torch.ops.fusepass.attention(*detached, [], seed, spec)),
            "python fwd µs": host_us(lambda: op.run_attention(*detached, [], seed, spec)),
            "op bwd µs": host_us(lambda: torch.ops.fusepass.attention_backward(*backward_args)),
            "python bwd µs": host_us(lambda: op.run_attention_backward(*backward_args))}


def floor(case, backward: bool, shape: tuple[int, ...]) -> dict:
    """Host µs per call with the flash kernels' functions replaced by one real call's results, and of
    FlexAttention's compiled call (see the module's docstring)."""
    cased = setup(case, shape, set(), backward)
    call = cased.step("fusepass", backward)
    call()
    forward, backward_fn = call.flash_attention_forward, call.flash_attention_backward
    results = {}

    def recorded(*args, **keywords):
        if "forward" not in results:
            results["forward"] = forward(*args, **keywords)
        return results["forward"]

    call.flash_attention_forward = recorded
    call.flash_attention_backward = lambda *args, **keywords: None  # writes the gradients in place
    try:
        floor_us = host_us(call)
    finally:
        call.flash_attention_forward, call.flash_attention_backward = forward, backward_fn
    return {"floor µs": floor_us, "flex host µs": host_us(cased.step("flex", backward))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="window,document,causal")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--shape", default="large", choices=SHAPES)
    args = parser.parse_args()
    spent = timed_launches()
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        call, (q, k, v) = fusepass_call(case, args.backward, SHAPES[args.shape])
        spent.clear()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        host_us = (time.perf_counter() - start) / CALLS * 1e6
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) / CALLS * 1e6
        launches_us = sum(spent.values()) / CALLS * 1e6
        row = {"case": case.name, "shape": args.shape, "pass": "fwd+bwd" if args.backward else "fwd",
               "host µs": host_us,
               "wall µs": wall_us, "launches µs": launches_us, "other µs": host_us - launches_us,
               "by kernel µs": ", ".join(f"{kernel} {seconds / CALLS * 1e6:.0f}"
                                         for kernel, seconds in spent.most_common())}
        if args.layers and not case.extra(1, 1, 1, "cuda"):  # the op is called here without aux tensors
            row.update(op_layers(q, k, v))
        if args.floor:
            row.update(floor(case, args.backward, SHAPES[args.shape]))
        rows.append(row)
        print(row, flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [call() for _ in range(CALLS)])
            torch.cuda.synchronize()
            for order in ("tottime", "cumulative"):
                pstats.Stats(profiler).sort_stats(order).print_stats(30)
    suite = "launch-cost-" + ("fwd-bwd" if args.backward else "fwd")
    print(keep(suite, list(rows[0]), rows))


if __name__ == "__main__":
    main()
