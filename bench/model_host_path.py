"""Host time of an example model's compiled training step with every kernel launch stubbed out: on any machine.

    PYTHONPATH=. python bench/model_host_path.py [--model bert|gpt2] [--size tiny] [--batch B] [--seq T]
        [--dynamic-after T0] [--forward] [--profile]

Builds examples/<model>.py's model (float32 on the CPU), compiles it with fusepass, replaces every launch of a
fused kernel (the pointwise and row kernels' `BoundLaunch`, the attention kernels' `launch`) with nothing, and
times steps (forward, the example's loss, backward): what fusepass's Python, torch's custom ops, AOTAutograd,
autograd and Dynamo's guards cost a step, beside the ATen ops the step still runs (on the CPU, their compute
too: keep the size small). The outputs of stubbed kernels are left unwritten: the figures are of the host path,
not of its results. With --profile, the Python functions with the most own and cumulative time. The launch counts
say how many kernels a step launches; a GPU step that takes longer than its kernels by about host µs per launch
× launches is host-bound. With --dynamic-after, a step at length T0 comes first, so that the length timed runs
the graphs Dynamo recompiled with symbolic sizes (a model trained at varying lengths). With --forward, the
forward alone without gradients (what `fusepass.compare` times as the forward; not T5's, whose graph without
gradients indexes its position table with a fused kernel's output, which a stub leaves unwritten).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import os
import pstats
import sys

assert "TRITON_INTERPRET" not in os.environ, "the stubs replace compiled launches, not the interpreter's"

import torch  # noqa: E402
from harness import fastest_batch_s, keep  # noqa: E402
from launch_cost import replace_attention_launches  # noqa: E402

from fusepass import pipeline  # noqa: E402
from fusepass.flash import config as flash_config  # noqa: E402
from fusepass.runtime import launch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
STEPS, BATCHES = 10, 5
# Each example's model at a size (its main builds it so), and its loss.
MODELS = {
    "bert": (lambda example, size: example.BertModel(example.SIZES[size]), "readout_loss"),
    "gpt2": (lambda example, size: example.GPT(example.SIZES[size]), "next_token_loss"),
    "t5": (lambda example, size: example.T5ForConditionalGeneration(example.SIZES[size]), "next_token_loss"),
}


def stub_launches() -> collections.Counter:
    """Every fused kernel's launch replaced by fusepass's part of it; the launches counted by kernel."""
    launched: collections.Counter = collections.Counter()

    def attention(kernel, grid, *args, **keywords):
        launch._bound_launch(kernel, args, keywords).signature_of.key(args)
        launched[kernel.fn.__name__] += 1

    def pointwise(self, grid, *args):
        if self.direct:
            self.signature_of.key(args)
        launched[getattr(self.kernel, "__name__", "pointwise")] += 1

    replace_attention_launches(attention)
    launch.BoundLaunch.__call__ = pointwise
    flash_config.compile_ahead = lambda *args, **keywords: None
    pipeline.kernels_can_run = lambda device: True  # the rewrites happen on any device
    return launched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bert", choices=sorted(MODELS))
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--dynamic-after", type=int, help="a step at this length first: T runs symbolic sizes")
    parser.add_argument("--forward", action="store_true", help="the forward alone, without gradients")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    launched = stub_launches()
    torch.set_num_threads(1)
    example = importlib.import_module(args.model)
    batch = args.batch or example.BATCH[args.size]
    seq = args.seq or example.SEQ[args.size]
    torch.manual_seed(0)
    build, loss_name = MODELS[args.model]
    model = build(example, args.size)
    inputs = example.inputs(model, batch, seq)
    loss = getattr(example, loss_name)
    compiled = torch.compile(model, backend="fusepass")

    def step():
        if args.forward:
            with torch.no_grad():
                compiled(*inputs)
        else:
            loss(compiled(*inputs)).backward()

    if args.dynamic_after:
        loss(compiled(*example.inputs(model, batch, args.dynamic_after))).backward()
    step()
    step()
    launched.clear()
    host_ms = fastest_batch_s(step, STEPS, BATCHES) * 1e3
    launches = sum(launched.values()) / STEPS / BATCHES
    row = {"model": args.model, "size": args.size, "batch": batch, "seq": seq,
           "sizes": "symbolic" if args.dynamic_after else "static", "pass": "forward" if args.forward else "step",
           "host ms a step": host_ms,
           "fused launches a step": launches,
           "kernels": ", ".join(f"{k} {n / STEPS / BATCHES:g}" for k, n in launched.most_common(8))}
    print(row, flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(STEPS)])
        for order in ("tottime", "cumulative"):
            pstats.Stats(profiler).sort_stats(order).print_stats(25)
    print(keep("model-host-path", list(row), [row]))


if __name__ == "__main__":
    main()
