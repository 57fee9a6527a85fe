"""The host time of each op of an example model's compiled graphs under fusepass, by kind of op: where a host-bound
step's time goes, on the GPU machine.

    PYTHONPATH=. python bench/host_by_op.py [--model gpt2] [--size small] [--batch 1] [--seq 128] [--rows 20]

Compiles the example with fusepass, runs its training step (forward, loss, backward) twice, and keeps the inputs
of each graph fusepass's backend compiled (the runnable graphs of `fusepass.runnable`). Then runs each graph
again, node by node, timing the host time of each call (no synchronize between nodes, one after each run of a
graph), and prints the calls by kind (an ATen op, a fused group, the attention op, a getitem) with how many a step
makes and their host µs. A small batch keeps the device ahead of the host, so that no call waits for a full
launch queue. Beside it the whole graph's host time run as compiled, and the launch replays' counters.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import time

import torch
import torch.fx
from profile_models import EXAMPLES, build

import fusepass
from fusepass import pipeline
from fusepass.runtime.replay import attention_replays, pointwise_replays

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
RUNS = 20
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the interpreter (TRITON_INTERPRET=1), a check


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def kind_of(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    name = getattr(target, "__name__", str(target))
    if type(target).__name__ in ("PointwiseLauncher", "RowLauncher"):
        return f"fused ({type(target).__name__})"
    return name


class TimedRun(torch.fx.Interpreter):
    """Runs a graph node by node, adding each call's host time to `spent` by the node's kind."""

    def __init__(self, module: torch.fx.GraphModule, spent: collections.Counter, calls: collections.Counter):
        super().__init__(module, garbage_collect_values=True)
        self.spent, self.calls = spent, calls

    def call_function(self, target, args, kwargs):
        start = time.perf_counter()
        result = target(*args, **kwargs)
        self.spent[self.kind] += time.perf_counter() - start
        self.calls[self.kind] += 1
        return result

    def run_node(self, n: torch.fx.Node):
        self.kind = kind_of(n)
        return super().run_node(n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    example = importlib.import_module(args.model)
    loss = getattr(example, EXAMPLES[args.model][1])
    graphs: list[list] = []  # [runnable graph, its last inputs]

    def keeping_inputs(module: torch.fx.GraphModule, annotate=None) -> torch.fx.GraphModule:
        made = runnable(module, annotate)
        entry = [made, None]
        graphs.append(entry)
        forward = made.forward

        def kept(*inputs):
            entry[1] = inputs
            return forward(*inputs)

        made.forward = kept
        return made

    runnable, pipeline.runnable = pipeline.runnable, keeping_inputs
    torch.manual_seed(0)
    model = build(example, args.size, args.seq).to(DEVICE, torch.bfloat16)
    inputs = tuple((x.to(torch.bfloat16) if x.is_floating_point() else x).to(DEVICE)
                   for x in example.inputs(model, args.batch, args.seq))
    compiled = torch.compile(model, backend=fusepass.backend())
    for _ in range(3):
        for p in model.parameters():
            p.grad = None
        loss(compiled(*inputs)).backward()
    sync()
    print(f"{args.model} {args.size} B{args.batch} T{args.seq}: {len(graphs)} graphs")
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    whole = 0.0
    for module, graph_inputs in graphs:
        if graph_inputs is None:
            continue
        for _ in range(3):  # warm: replays captured
            TimedRun(module, collections.Counter(), collections.Counter()).run(*graph_inputs)
            module.forward(*graph_inputs)
        sync()
        start = time.perf_counter()
        for _ in range(RUNS):
            module.forward(*graph_inputs)
            sync()
        whole += (time.perf_counter() - start) / RUNS
        for _ in range(RUNS):
            TimedRun(module, spent, calls).run(*graph_inputs)
            sync()
    total = sum(spent.values()) / RUNS
    print(f"host per step, graphs run as compiled (each followed by a synchronize): {whole * 1e3:.2f} ms; "
          f"the calls alone, node by node: {total * 1e3:.2f} ms")
    print("| op | calls a step | host ms a step | µs a call |\n|---|---|---|---|")
    for kind, seconds in spent.most_common(args.rows):
        n = calls[kind] / RUNS
        print(f"| {kind} | {n:g} | {seconds / RUNS * 1e3:.3f} | {seconds / RUNS / n * 1e6:.1f} |")
    for name, r in (("pointwise", pointwise_replays), ("attention", attention_replays)):
        print(f"{name} replays: {r.replayed} replayed, {len(r._replays)} held, {r.dropped} dropped, "
              f"{len(r._refused)} refused")


if __name__ == "__main__":
    main()
