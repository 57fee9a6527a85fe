"""How many of an example model's launch sequences replay as CUDA graphs in each training step, and the step's time
with replays on and off: a host-bound step whose sequences do not settle into replays pays every launch's Python.

    PYTHONPATH=. python bench/replay_steps.py [--models t5,bert] [--size small] [--steps 8]

Per model (bf16, fusepass's default options but `replay`), the step (forward, the example's loss, backward) runs
`--steps` times; per step, the attention sequences run and replayed, and the pointwise launches replayed
(`fusepass.runtime.replay`), and how many of its sequences met a key no earlier step met, by what moved: `IN` where
its inputs' pointers are new to its call site, `OUT` where the outputs' are (lower case: a set an earlier step had).
Then the median step with replays on and off.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
from harness import keep, median_ms

import fusepass
from fusepass.runtime.replay import attention_replays, pointwise_replays

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from profile_models import EXAMPLES, build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="t5,bert")
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    runs = {"n": 0}
    run = attention_replays.run
    keys: list[tuple] = []  # this step's sequences: (values, input pointers, allocated pointers)

    def counted(tensors, values, launches, allocated=()):
        runs["n"] += 1
        keys.append((values, tuple(t.data_ptr() for t in tensors), tuple(t.data_ptr() for t in allocated)))
        return run(tensors, values, launches, allocated)

    attention_replays.run = counted
    rows = []
    for name in args.models.split(","):
        example = importlib.import_module(name)
        loss = getattr(example, EXAMPLES[name][1])
        batch, seq = example.BATCH[args.size], example.SEQ[args.size]
        for replay in (True, False):
            torch.manual_seed(0)
            torch._dynamo.reset()
            attention_replays.clear()
            pointwise_replays.clear()
            model = build(example, args.size, seq).cuda().to(torch.bfloat16)
            inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x
                           for x in example.inputs(model, batch, seq))
            compiled = torch.compile(model, backend=fusepass.backend(replay=replay))
            inputs_seen: dict = {}
            outputs_seen: dict = {}

            def step():
                loss(compiled(*inputs)).backward()

            per_step, seen = [], set()
            for _ in range(args.steps):
                before = runs["n"], attention_replays.replayed, pointwise_replays.replayed
                keys.clear()
                step()
                # Of the sequences whose key no earlier step met: how many moved an input, an output, or both.
                new = [key for key in keys if key not in seen]
                moved = {(tuple(key[1]) in inputs_seen[key[0]], tuple(key[2]) in outputs_seen[key[0]])
                         for key in new} if per_step else set()
                seen.update(keys)
                for values, input_pointers, output_pointers in keys:
                    inputs_seen.setdefault(values, set()).add(input_pointers)
                    outputs_seen.setdefault(values, set()).add(output_pointers)
                per_step.append(f"{attention_replays.replayed - before[1]}/{runs['n'] - before[0]} "
                                f"pw {pointwise_replays.replayed - before[2]} new {len(new)}"
                                + "".join(f" {'in' if i else 'IN'}{'out' if o else 'OUT'}" for i, o in sorted(moved)))
            row = {"model": name, "replay": replay, "step ms": median_ms(step),
                   "attention replayed / run, pointwise replayed, per step": "; ".join(per_step)}
            print(row, flush=True)
            rows.append(row)
            del compiled, model
            torch.cuda.empty_cache()
    print(keep("replay-steps", list(rows[0]), rows))


if __name__ == "__main__":
    main()
