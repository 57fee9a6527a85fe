"""Where an example model's training step holds its memory, per backend: reserved and allocated after each phase
and by memory pool (the CUDA graph trees keep a pool of their own), bf16 on the GPU.

    PYTHONPATH=. python bench/peaks.py [--models bert,vit,gpt2+loss] [--backends inductor,fusepass,...] [--at-peak 8]

`bench/models.py`'s peak is `max_memory_reserved` over one step after the timings; with whole-graph replays it
stood above Inductor's default for BERT, ViT and GPT-2 (bench/NOTES.md, item 000). Each backend runs in a process
of its own (a clean allocator), warms up (compiles, records), then runs the inference forward and a training step
with the gradients set to None first (as `compare` does), reading the allocator after each phase:

- inference: after two forwards under no_grad (a replayed backend holds its inference recording's pool);
- forward, backward: allocated after each, the step's peak allocated and reserved;
- pools: reserved per pool at the end (the default pool, the trees' pool, per-op replay pools).

A model named `name+loss` compiles its loss with it (the examples' `--loss-compiled`). `--at-peak N` records the
allocator's history over the step and lists the N largest blocks allocated in the step and live at its peak, each
with the frames of fusepass, the example, Inductor's generated code or an FX graph's code that allocated it (printed,
and kept in the .json).

Backends: Inductor's default and its `mode="reduce-overhead"`, fusepass without and with whole-graph replays (which
lend their gradients out of the pool, `lent_outputs.LEND_GRADIENTS`), and `fusepass-graphs-copied`: replays that copy
each gradient out of the pool instead.

Writes bench/results/peaks-<date>.md and .json; GiB above what was reserved before the model's first call.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

import torch
from harness import keep

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
BACKENDS = ["inductor", "inductor-reduce-overhead", "fusepass", "fusepass-graphs", "fusepass-graphs-copied"]
COLUMNS = ["model", "backend", "inference reserved", "after forward allocated", "after backward allocated",
           "peak allocated", "peak reserved", "default pool", "other pools"]


def _pieces(name: str) -> tuple:
    """The example's model builder, inputs, loss and default sizes, taken from the call its `main` makes to
    `run_model`; `name+loss`: the model and its loss as one module."""
    sys.path.insert(0, EXAMPLES)
    name, _, with_loss = name.partition("+")
    module = importlib.import_module(name)
    taken = {}

    def capture(label, build, make_inputs, loss, sizes, default_batch, default_seq, argv=None, **_):
        taken.update(build=build, make_inputs=make_inputs, loss=loss, batch=default_batch["small"],
                     seq=default_seq["small"])

    module.run_model = capture
    module.main([])
    build, make_inputs, loss = taken["build"], taken["make_inputs"], taken["loss"]
    if with_loss:
        from common import WithLoss

        build = (lambda size, seq, inner=build, loss=loss: WithLoss(inner(size, seq), loss))
        make_inputs = (lambda model, batch, seq, inner=make_inputs: inner(model.model, batch, seq))
        loss = torch.Tensor.sum  # the compiled function's output is the loss
    return build, make_inputs, loss, taken["batch"], taken["seq"]


def _compiled(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    import fusepass

    if backend == "inductor":
        return torch.compile(model)
    if backend == "inductor-reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    if backend == "fusepass-graphs-copied":
        from fusepass.runtime import lent_outputs

        lent_outputs.LEND_GRADIENTS = False
    return torch.compile(model, backend=fusepass.backend(graphs=backend.startswith("fusepass-graphs")))


def _gib(n: int) -> float:
    return n / 2**30


def _pools() -> tuple[int, int]:
    """Reserved bytes in the default pool and in all others (a pool id of (0, 0) is the default)."""
    default = other = 0
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0):
            default += segment["total_size"]
        else:
            other += segment["total_size"]
    return default, other


_OWN_FRAMES = ("fusepass/", "examples/", "torchinductor", "<eval_with_key>")


def _frames(frames: list[dict], count: int = 3) -> str:
    """The innermost `count` frames of the model's, fusepass's or the compiled graphs' code."""
    own = [f for f in frames if any(mark in f["filename"] for mark in _OWN_FRAMES)]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in own[:count]) or "?"


def at_peak(trace: list[dict], count: int) -> list[str]:
    """The `count` largest blocks allocated during `trace` (the allocator's events of one step) and live when the
    memory it allocated peaked, largest first, as `GiB  frames`."""
    live, now, peak, peak_at = {}, 0, 0, 0
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
        if now > peak:
            peak, peak_at = now, i
    live = {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    largest = sorted(live.values(), key=lambda e: -e["size"])[:count]
    return [f"{_gib(peak):.3f} GiB allocated in the step at its peak, {len(live)} blocks; the largest:"] + \
        [f"  {_gib(e['size']):.3f}  {_frames(e.get('frames', []))}" for e in largest]


def measure(name: str, backend: str, peak_blocks: int = 0) -> dict:
    build, make_inputs, loss, batch, seq = _pieces(name)
    torch.manual_seed(0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    model = build("small", seq).to("cuda", torch.bfloat16)
    inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in make_inputs(model, batch, seq))
    fn = _compiled(model, backend)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss(fn(*inputs)).backward()

    for _ in range(3):  # compiles, warms up, records
        with torch.no_grad():
            fn(*inputs)
        step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.no_grad():
        fn(*inputs)
        fn(*inputs)
    torch.cuda.synchronize()
    row = {"model": name, "backend": backend, "inference reserved": _gib(torch.cuda.memory_reserved() - before)}
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if peak_blocks:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    out = fn(*inputs)
    torch.cuda.synchronize()
    row["after forward allocated"] = _gib(torch.cuda.memory_allocated() - before)
    loss(out).backward()
    del out
    torch.cuda.synchronize()
    row["after backward allocated"] = _gib(torch.cuda.memory_allocated() - before)
    row["peak allocated"] = _gib(torch.cuda.max_memory_allocated() - before)
    row["peak reserved"] = _gib(torch.cuda.max_memory_reserved() - before)
    default, other = _pools()
    row["default pool"], row["other pools"] = _gib(default - before), _gib(other)
    if peak_blocks:
        row["at peak"] = at_peak(torch.cuda.memory._snapshot()["device_traces"][0], peak_blocks)
        torch.cuda.memory._record_memory_history(enabled=None)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="bert,vit")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--at-peak", type=int, default=0, help="list this many blocks live at the step's peak")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # model:backend, measured in this process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with open(args.out, "w") as f:
            json.dump(measure(*args.one.split(":"), peak_blocks=args.at_peak), f)
        return
    rows = []
    for name in args.models.split(","):
        for backend in args.backends.split(","):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", f"{name}:{backend}",
                                       "--out", out.name, "--at-peak", str(args.at_peak)],
                                      capture_output=True, text=True)
                row = json.load(open(out.name)) if done.returncode == 0 else \
                    {"model": name, "backend": f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:160]}"}
            print("\n".join([f"== {name} {backend}"] + row.get("at peak", [])), flush=True)  # (kept in the .json)
            rows.append(row)
            print(row, flush=True)
    print(keep("peaks", COLUMNS, rows, "bf16, GiB above what was reserved before the model's first call; the "
                                       "step after two inference forwards, gradients set to None first"))


if __name__ == "__main__":
    main()
