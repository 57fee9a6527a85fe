"""What a new sequence length costs a training step once the compile has gone dynamic: a GPT-2 block (nanoGPT's
attention, its `tril` buffer) or a BERT layer (a padding mask the kernels load, its strides and bounds run-time
values under symbolic sizes) trained at lengths one after another, fusepass beside Inductor, in one process.

    PYTHONPATH=. python bench/new_lengths.py [--model gpt2|bert] [--lengths 1024,1536,2048,3000,3008,1040,4096,1536]
        [--batch 4] [--layers 1] [--profile-planning] [--kernels 12]

Per backend and length: the first step's seconds, the step's median after it (ms), the first step's seconds
beyond that median (what the new length cost), the Triton kernels compiled or loaded during that first step
(their names: a kernel that comes back at each length is specialised on it), and for fusepass the seconds its
attention spent planning the length and its per-op launch sequences replayed, captured and lost (captured, their
keys not back in time) in the timed steps (a capture costs a call far more than a replay saves). The second length
recompiles with symbolic sizes (Dynamo's default); the lengths after it are what a user training at varying lengths
pays. `--profile-planning` runs the planning under cProfile and adds where it spent its time: the functions of most
time of their own (planning's seconds then include the profiler's). `--kernels N` prints, per backend and length,
the N ops of most device time in one step after the timed ones (torch.profiler).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import bert  # noqa: E402
import gpt2  # noqa: E402
from harness import keep  # noqa: E402

import fusepass  # noqa: E402
from fusepass.attention import dynamic  # noqa: E402
from fusepass.runtime.replay import attention_replays, pointwise_replays  # noqa: E402


class _Kernels:
    """The Triton kernels compiled (or loaded from Triton's cache) meanwhile, by name. Through Triton's compilation
    listener: its JIT hooks serialize a kernel's constexpr arguments, which fails on the attention kernels' score
    functions (a hook set here made the Triton forward fail at its first compile and run unfused: bench/NOTES.md)."""

    def __init__(self) -> None:
        self.names: collections.Counter[str] = collections.Counter()
        import triton
        triton.knobs.compilation.listener = self._compiled

    def _compiled(self, *, src, **_: object) -> None:
        self.names[src.name] += 1

    def take(self) -> str:
        names, self.names = self.names, collections.Counter()
        return " ".join(f"{name}×{n}" if n > 1 else name for name, n in sorted(names.items())) or "-"


class _Planning:
    """Seconds fusepass's attention spent planning new sizes meanwhile, the plans it made, and where the time went
    (`profiled`: the functions of most time of their own, under cProfile)."""

    def __init__(self, profiled: bool) -> None:
        self.seconds, self.plans = 0.0, 0
        self.profile = cProfile.Profile() if profiled else None
        plan = dynamic.plan_static

        def timed(*args, **kwargs):
            start = time.perf_counter()
            if self.profile is not None:
                self.profile.enable()
            try:
                return plan(*args, **kwargs)
            finally:
                if self.profile is not None:
                    self.profile.disable()
                self.seconds += time.perf_counter() - start
                self.plans += 1
        dynamic.plan_static = timed

    def take(self) -> tuple[float, int, str]:
        taken = self.seconds, self.plans, self._most()
        self.seconds, self.plans = 0.0, 0
        if self.profile is not None:
            self.profile = cProfile.Profile()
        return taken

    def _most(self, count: int = 4) -> str:
        """The `count` functions of most time of their own since the last take, with their seconds."""
        if self.profile is None or not self.plans:
            return "-"
        stats = pstats.Stats(self.profile).stats  # (file, line, name) → (calls, primitive, own s, cumulative s, ...)
        most = sorted(stats.items(), key=lambda item: -item[1][2])[:count]
        return ", ".join(f"{os.path.basename(file)}:{name} {own:.3f}" for (file, _, name), (_, _, own, *_) in most)


class _Stack(torch.nn.Module):
    """Blocks (GPT-2's, of x) or layers (BERT's, of x and the mask) one after another."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, *mask)
        return x


def _step(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    model(*inputs).float().square().mean().backward()
    if inputs[0].is_cuda:
        torch.cuda.synchronize()


def _replay_counts() -> tuple[int, int, int]:
    """fusepass's per-op launch sequences replayed and captured so far (the attention's and the fused groups'), and
    the captures judged lost (their keys not back in time)."""
    return tuple(getattr(attention_replays, count) + getattr(pointwise_replays, count)
                 for count in ("replayed", "captured", "missed"))


def _print_kernels(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], title: str, count: int) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if inputs[0].is_cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        _step(model, inputs)
    by = "self_cuda_time_total" if inputs[0].is_cuda else "self_cpu_time_total"
    print(f"== {title}\n{profile.key_averages().table(sort_by=by, row_limit=count, max_name_column_width=90)}")


def _model(name: str, width: int, lengths: list[int], layers: int, device: str) -> torch.nn.Module:
    if name == "gpt2":
        # A context longer than every length: slicing the mask buffer to its full length would recompile (both
        # backends).
        blocks = [gpt2.Block(gpt2.Config(1, 12, width, context=2 * max(lengths))) for _ in range(layers)]
    else:
        blocks = [bert.BertLayer(bert.Config(1, width, 12, 4 * width)) for _ in range(layers)]
    return (blocks[0] if layers == 1 else _Stack(blocks)).to(device, torch.bfloat16)


def _inputs(name: str, batch: int, n: int, width: int, device: str) -> tuple[torch.Tensor, ...]:
    """The hidden states, and for BERT its additive mask of the padding (the last quarter of every other row)."""
    x = torch.randn(batch, n, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    if name == "gpt2":
        return (x,)
    keep = torch.ones(batch, n, device=device)
    keep[1::2, n - n // 4:] = 0
    return x, ((1.0 - keep[:, None, None, :]) * torch.finfo(torch.bfloat16).min).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt2", "bert"), default="gpt2")
    parser.add_argument("--lengths", default="1024,1536,2048,3000,3008,1040,4096,1536")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--width", type=int, default=768, help="12 heads of width/12 (a smaller one to try it on the CPU)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--profile-planning", action="store_true")
    parser.add_argument("--kernels", type=int, default=0, help="the ops of most device time in a step, this many")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels, planning = _Kernels(), _Planning(args.profile_planning)
    rows = []
    for backend in ("inductor", "fusepass"):
        torch.manual_seed(0)
        block = _model(args.model, args.width, lengths, args.layers, device)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=backend)
        kernels.take(), planning.take()
        for n in lengths:
            inputs = _inputs(args.model, args.batch, n, args.width, device)
            start = time.perf_counter()
            _step(compiled, inputs)
            first = time.perf_counter() - start
            compiled_now, (planned, plans, most) = kernels.take(), planning.take()
            replays_before = _replay_counts()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                _step(compiled, inputs)
                times.append(time.perf_counter() - start)
            step = sorted(times)[len(times) // 2]
            replayed, captured, missed = (after - before for after, before in zip(_replay_counts(), replays_before))
            if args.kernels:
                _print_kernels(compiled, inputs, f"{backend} at {n}", args.kernels)
            rows.append({"backend": backend, "length": n, "first s": round(first, 3), "step ms": round(step * 1e3, 2),
                         "new length s": round(first - step, 3),
                         "planning s": round(planned, 3) if backend == "fusepass" else None,
                         "plans": plans if backend == "fusepass" else None,
                         "kernels compiled or loaded": compiled_now,
                         "per-op replays, captures, lost (timed steps)":
                             f"{replayed}, {captured}, {missed}" if backend == "fusepass" else None,
                         **({"planning's own time, most first": most} if args.profile_planning else {})})
    print(keep("new-lengths", list(rows[0]), rows,
               notes=f"{'GPT-2 block' if args.model == 'gpt2' else 'BERT layer, padded'} (d {args.width}, 12 heads, "
                     f"bf16) × {args.layers}, batch {args.batch}, a training step per length"))


if __name__ == "__main__":
    main()
