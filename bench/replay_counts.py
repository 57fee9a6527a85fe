"""How the attention op's calls went through its launch replays (fusepass.runtime.replay) in a timed loop: per
case, of the op's forward and backward calls, how many replayed a graph, and the keys met once, captured or
refused; beside the host µs per call (no synchronization) and the wall ms per call.

    PYTHONPATH=. python bench/replay_counts.py [--cases document,window] [--shape small] [--calls 200]
"""
from __future__ import annotations

import argparse
import time

import torch
from attention import CASES, SHAPES, fusepass_call
from harness import keep

from fusepass.runtime.replay import attention_replays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="document,window")
    parser.add_argument("--shape", default="small")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for name in args.cases.split(","):
        attention_replays.clear()
        call, _ = fusepass_call(CASES[name], True, SHAPES[args.shape])
        replayed = attention_replays.replayed
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        rows.append({"case": CASES[name].name, "op calls": 2 * args.calls,
                     "replayed": attention_replays.replayed - replayed, "graphs": len(attention_replays._replays),
                     "keys seen once": len(attention_replays._seen), "refused": len(attention_replays._refused),
                     "dropped": attention_replays.dropped, "host µs per call": host / args.calls * 1e6,
                     "wall ms per call": wall / args.calls * 1e3})
        print(rows[-1], flush=True)
    print(keep("replay-counts-" + args.shape, list(rows[0]), rows))


if __name__ == "__main__":
    main()
