"""A compiled attention call without its host time: the call captured once as a CUDA graph and replayed,
beside the call as it runs, for fusepass and FlexAttention.

    PYTHONPATH=. python bench/graph_replay.py [--cases window,document,causal] [--shape small] [--no-backward]

Each case of ``bench/attention.py`` is set up as the suite does (warm), timed as it runs, then captured with
``torch.cuda.graph`` and its replay timed: a replay launches the same kernels without any Python, so the gap
between the two is the host time a call leaves the GPU waiting, and the replay is what replaying compiled
graphs (Inductor's reduce-overhead mode does so) would reach. The replay's outputs are compared with a call's
on the same inputs. A call that waits on the device cannot be captured: its row says why.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from attention import CASES, SHAPES, setup
from harness import keep, median_ms, relative_error


def captured(step: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """`step` captured as a CUDA graph (warmed up on a side stream first, as capture asks), and the tensors its
    replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="window,document,causal")
    parser.add_argument("--shape", default="small", choices=SHAPES)
    parser.add_argument("--no-backward", action="store_true")
    args = parser.parse_args()
    backward = not args.no_backward
    rows = []
    for name in args.cases.split(","):
        cased = setup(CASES[name], SHAPES[args.shape], set(), backward)
        row = {"case": CASES[name].name, "shape": args.shape, "pass": "fwd+bwd" if backward else "fwd"}
        for variant in ("fusepass", "flex"):
            step = cased.step(variant, backward)
            step()
            row[f"{variant} ms"] = median_ms(step)
            try:
                graph, outputs = captured(step)
                graph.replay()
                row[f"{variant} replay error"] = max(relative_error(got, expected)
                                                     for got, expected in zip(outputs, step()))
                row[f"{variant} replay ms"] = median_ms(graph.replay)
            except Exception as error:  # a call that cannot be captured is reported, the suite goes on
                row[f"{variant} replay"] = f"{type(error).__name__}: {str(error)[:120]}"
        rows.append(row)
        print(row, flush=True)
    columns = ["case", "shape", "pass", "fusepass ms", "fusepass replay ms", "flex ms", "flex replay ms",
               "fusepass replay error", "flex replay error", "fusepass replay", "flex replay"]
    print(keep("graph-replay", [c for c in columns if any(c in r for r in rows)], rows))


if __name__ == "__main__":
    main()
