"""Which kernels one training step of an example model runs, and for how long, under Inductor and fusepass.

    PYTHONPATH=. python bench/profile_models.py [--models t5,bert] [--size small] [--batch 8] [--seq 512] [--rows 14]
                                                [--forward] [--host] [--records] [--options JSON]
                                                [--backends inductor,fusepass]

Builds each model at its size (``small`` unless given) in bf16, runs its step (forward, loss, backward) warm under both backends,
profiles three steps with torch.profiler and prints each backend's kernels by device time: a model row of
bench/models.py that trails Inductor is explained by a kernel fusepass runs that Inductor's does not, or by one
slower than its bytes say. Each backend's line gives the call's median beside its kernels' device time: a call
that takes longer than its kernels is host-bound. --host adds the Python functions where fusepass's call spends
its host time (cProfile over 20 calls); --records, fusepass.profile's table (kernel time by report record);
--notices, what fusepass's reports note (a graph that runs as compiled where whole-graph replays were asked, and why).
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import os
import pstats
import sys

import torch
from harness import device_ms, kernels_by_device_time, median_ms

import fusepass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
# Each example's model class and the loss its training step takes.
EXAMPLES = {"bert": ("BertModel", "readout_loss"), "t5": ("T5ForConditionalGeneration", "next_token_loss"),
            "gpt2": ("GPT", "next_token_loss"), "llama": ("LlamaForCausalLM", "next_token_loss"),
            "vit": ("VisionTransformer", "classification_loss"), "bloom": ("BloomForCausalLM", "next_token_loss"),
            "gemma2": ("Gemma2ForCausalLM", "next_token_loss")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="t5,bert")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--forward", action="store_true", help="profile the forward under no_grad, not the step")
    parser.add_argument("--host", action="store_true", help="where fusepass's call spends its host time")
    parser.add_argument("--records", action="store_true", help="fusepass.profile's table")
    parser.add_argument("--notices", action="store_true", help="the notices of fusepass's reports")
    parser.add_argument("--options", default="{}", help='fusepass.backend\'s options as JSON, e.g. \'{"replay": false}\'')
    parser.add_argument("--backends", default="inductor,fusepass")
    args = parser.parse_args()
    for name in args.models.split(","):
        example = importlib.import_module(name)
        batch, seq = args.batch or example.BATCH[args.size], args.seq or example.SEQ[args.size]
        loss = getattr(example, EXAMPLES[name][1])
        backends = {"inductor": "inductor", "fusepass": fusepass.backend(**json.loads(args.options))}
        for backend in (backends[chosen] for chosen in args.backends.split(",")):
            torch.manual_seed(0)
            torch._dynamo.reset()
            fusepass.reset()
            built = build(example, args.size, seq).cuda().to(torch.bfloat16)
            inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x
                           for x in example.inputs(built, batch, seq))
            compiled = torch.compile(built, backend=backend)

            def step():
                if args.forward:
                    with torch.no_grad():
                        compiled(*inputs)
                    return
                out = compiled(*inputs)
                loss(out).backward()

            step()
            ms = median_ms(step)
            label = backend if isinstance(backend, str) else "fusepass"
            what = "forward" if args.forward else "step"
            print(f"== {name} B{batch} T{seq} under {label}: {ms:.2f} ms per {what} (median), "
                  f"{device_ms(step):.2f} ms of kernels")
            print(kernels_by_device_time(step, steps=3, rows=args.rows))
            if label == "fusepass" and args.host:
                torch.cuda.synchronize()
                profiler = cProfile.Profile()
                profiler.runcall(lambda: [step() for _ in range(20)])
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            if label == "fusepass" and args.notices:
                for report in fusepass.reports():
                    print("\n".join(f"notice: {notice}" for notice in report.notices))
            if label == "fusepass" and args.records:
                print(fusepass.profile(built, *inputs, loss=None if args.forward else loss))
            del compiled, built
            torch.cuda.empty_cache()


def build(example, size: str, seq: int) -> torch.nn.Module:
    """The example's model at `size`, as its main builds it (run_model's `build`)."""
    captured = {}

    def run_model(name, build, *rest, **kwargs):
        captured["model"] = build(size, seq)

    example.run_model, original = run_model, example.run_model
    try:
        example.main([])
    finally:
        example.run_model = original
    return captured["model"]


if __name__ == "__main__":
    main()
