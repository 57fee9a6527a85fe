"""Whether an example model's compiled call is host-bound, and where: the host time to enqueue a call beside the
wall time of calls in a row and their kernels' device time, under fusepass with and without replay and under
Inductor, in one process (a training step also with its gradients set to None first, as fusepass.compare times
it), with the launch replays' counters (--calls: the host time by CUDA call and op, and fusepass's pointwise and
attention launches not replayed); beside them the host cost of plain torch calls (an empty tensor, a CUDA graph's replay),
before and after the compiles, and the threads alive: a machine or process whose every call is slow shows there.

    PYTHONPATH=. python bench/host_bound.py [--model gpt2] [--size small] [--train] [--calls]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import time

import torch
from harness import device_ms
from profile_models import EXAMPLES, build

import fusepass
from fusepass.runtime.replay import attention_replays, pointwise_replays

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
CALLS = 30


def host_us(fn, calls: int = 2000) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def plain_calls() -> str:
    x = torch.empty(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            x.add_(1)
    torch.cuda.synchronize()
    empty, add, replay = (host_us(lambda: torch.empty(8, device="cuda")), host_us(lambda: x.add_(1)),
                          host_us(graph.replay))
    torch.cuda.synchronize()
    return f"host µs per call: torch.empty {empty:.1f}, x.add_ {add:.1f}, CUDAGraph.replay {replay:.1f}"


def replay_counts() -> str:
    """The launch replays' counters so far: calls replayed, graphs held and dropped, keys refused."""
    return "; ".join(f"{name} replays: {r.replayed} replayed, {len(r._replays)} held, {r.dropped} dropped, "
                     f"{len(r._refused)} refused" for name, r in (("pointwise", pointwise_replays),
                                                                  ("attention", attention_replays)))


def synced_host_ms(call) -> float:
    """The median host time to enqueue one call made with the device idle (a synchronize before each)."""
    times = []
    for _ in range(CALLS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e3


def timings(call) -> str:
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    enqueued = (time.perf_counter() - start) / CALLS * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / CALLS * 1e3
    return (f"host {enqueued:.2f} ms to enqueue a call in a row, {wall:.2f} ms a call in a row, "
            f"{synced_host_ms(call):.2f} ms to enqueue one on an idle device, {device_ms(call):.2f} ms of kernels")


def host_calls(call, calls: int = 5, rows: int = 12) -> str:
    """The CUDA runtime and driver calls and the ops with the most host time over `calls` calls in a row (every
    thread's: the backward runs on autograd's): a call that waits on the device shows there."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    events = sorted(trace.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return "\n".join(f"    {e.key[:60]:60s} {e.count / calls:7.1f} a call {e.self_cpu_time_total / calls / 1e3:8.2f} ms"
                     for e in events)


def without_replays(replays) -> None:
    """Every later launch of `replays`' sequences launched, not replayed."""
    replays.clear()
    replays.dropped = replays.capacity


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--calls", action="store_true", help="host time by runtime call and op; fusepass's "
                        "pointwise, then also its attention launches not replayed")
    args = parser.parse_args()
    example = importlib.import_module(args.model)
    batch, seq = example.BATCH[args.size], example.SEQ[args.size]
    loss = getattr(example, EXAMPLES[args.model][1])
    print("before:", plain_calls(), flush=True)
    backends = [("inductor", "inductor"), ("fusepass", fusepass.backend())]
    if not args.calls:  # which replays matter: --calls turns them off one kind at a time
        backends.append(("fusepass replay=False", fusepass.backend(replay=False)))
    for label, backend in backends:
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = build(example, args.size, seq).cuda().to(torch.bfloat16)
        inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in example.inputs(model, batch, seq))
        compiled = torch.compile(model, backend=backend)

        def call():
            if args.train:
                loss(compiled(*inputs)).backward()
            else:
                with torch.no_grad():
                    compiled(*inputs)

        def call_with_grads_dropped():  # the step as fusepass.compare times it: every gradient allocated anew
            for p in model.parameters():
                p.grad = None
            call()

        call()
        print(f"{label}: {timings(call)}; {replay_counts()}", flush=True)
        if args.train:
            call_with_grads_dropped()
            print(f"  gradients set to None first: {timings(call_with_grads_dropped)}; {replay_counts()}", flush=True)
        timed = call_with_grads_dropped if args.train else call
        if args.calls:
            print(f"  host time by call, in a row:\n{host_calls(timed)}", flush=True)
        if args.calls and label == "fusepass":
            for name, replays in (("pointwise", pointwise_replays), ("attention", attention_replays)):
                without_replays(replays)
                print(f"  {name} launches not replayed: {timings(timed)}", flush=True)
        print(f"  then {plain_calls()}", flush=True)
        del compiled, model
        torch.cuda.empty_cache()
    print("threads:", ", ".join(f"{t.name}{'' if t.daemon else ' (not daemon)'}" for t in threading.enumerate()))


if __name__ == "__main__":
    main()
