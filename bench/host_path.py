"""Host time of one compiled attention call with every Triton launch stubbed out: on any machine, the CPU too.

    PYTHONPATH=. python bench/host_path.py [--cases window,causal,document] [--backward] [--profile]
        [--device cpu] [--seq 256] [--calls N] [--replayed]

Runs each case of ``bench/attention.py`` under fusepass at the small shape's batch, heads and head dim (B8 H16
D64; `--seq` keys, 256 unless told: the host path does not depend on it, the allocations do) with each launch
replaced by what fusepass does before Triton's launcher (`BoundLaunch` lookup and the argument signature), and
times 9 batches of 100 calls (the fastest batch): what the op's Python, torch's custom-op, AOTAutograd and
autograd layers and Dynamo's guards cost per call, without Triton's launcher or the driver (``launch_cost.py``
on the GPU has those). The kernels' outputs are left unwritten, so the figures are of the host path alone, not
of its results. With --profile, the Python functions with the most host time, by own and by cumulative time.
With --replayed, every attention call takes the path of a replayed one (`fusepass.runtime.replay`: the op
allocates its outputs and looks its launches up), without the driver's replay.

Wall time on a shared virtual machine moves by up to 2x from run to run; instructions do not. With --calls N it
makes N calls of the first case, untimed, and exits: the difference of two runs' instruction counts under
``valgrind --tool=cachegrind --cache-sim=no`` (N = 20 and 120, say) over 100 is the instructions per call.
Run it with OMP_NUM_THREADS=1: torch's intra-op threads otherwise spin before `set_num_threads(1)` takes hold,
and counts of one state moved by ±12 % (two runs agree to 0.2 % with it; host-instructions-2026-11-30-1535).
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import os
import pstats

assert "TRITON_INTERPRET" not in os.environ, "the stubs replace compiled launches, not the interpreter's"

import torch  # noqa: E402
from attention import CASES, SHAPES, fusepass_call  # noqa: E402
from harness import fastest_batch_s, keep  # noqa: E402
from launch_cost import replace_attention_launches  # noqa: E402

from fusepass import pipeline  # noqa: E402
from fusepass.attention import call as attention_call  # noqa: E402
from fusepass.runtime import launch  # noqa: E402
from fusepass.flash import config as flash_config
from fusepass.runtime.replay import LaunchReplays, tensor_key  # noqa: E402

# The fastest batch (torch on one thread): a virtual machine's neighbours only ever add, by up to 2x on this
# one from run to run.
CALLS, BATCHES = 100, 9


def stub_launches() -> collections.Counter:
    """Replace every attention kernel's launch by fusepass's part of it; count the launches by kernel."""
    launched: collections.Counter = collections.Counter()

    def stubbed(kernel, grid, *args, **keywords):
        launch._bound_launch(kernel, args, keywords).signature_of.key(args)
        launched[kernel.fn.__name__] += 1

    replace_attention_launches(stubbed)
    flash_config.compile_ahead = lambda *args, **keywords: None
    pipeline.kernels_can_run = lambda device: True  # the rewrites happen on any device
    return launched


class ReplayedEveryCall(LaunchReplays):
    """What a replayed call's host path adds, without the driver's replay: the key and its lookup, on any
    device; nothing is launched."""

    @staticmethod
    def can_replay(t: torch.Tensor) -> bool:
        return True

    @staticmethod
    def key(tensors, values, allocated) -> tuple:  # device 0: torch.cuda may be absent
        return values, 0, *(tensor_key(t) for t in tensors), *(t.data_ptr() for t in allocated)

    def run(self, tensors, values, launches, allocated=()) -> None:
        self._replays.get(self.key(tensors, values, allocated))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="window,causal,document")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--calls", type=int)
    parser.add_argument("--replayed", action="store_true", help="every attention call replayed (a hit)")
    args = parser.parse_args()
    launched = stub_launches()
    if args.replayed:
        attention_call.attention_replays = ReplayedEveryCall()
    torch.set_num_threads(1)
    b, h, _, d, kv_heads = SHAPES["small"]
    if args.calls is not None:
        call, _ = fusepass_call(CASES[args.cases.split(",")[0]], args.backward, (b, h, args.seq, d, kv_heads),
                                args.device)
        for _ in range(args.calls):
            call()
        return
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        call, _ = fusepass_call(case, args.backward, (b, h, args.seq, d, kv_heads), args.device)
        launched.clear()
        host_us = fastest_batch_s(call, CALLS, BATCHES) * 1e6
        rows.append({"case": case.name, "pass": "fwd+bwd" if args.backward else "fwd", "device": args.device,
                     "host µs": host_us, "launches per call": ", ".join(
                         f"{kernel} {count / CALLS / BATCHES:g}" for kernel, count in launched.most_common())})
        print(rows[-1], flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [call() for _ in range(CALLS)])
            for order in ("tottime", "cumulative"):
                pstats.Stats(profiler).sort_stats(order).print_stats(30)
    print(keep("host-path-" + ("fwd-bwd" if args.backward else "fwd") + ("-replayed" if args.replayed else ""),
               list(rows[0]), rows))


if __name__ == "__main__":
    main()
