"""The example models at realistic sizes on the GPU: eager, Inductor and fusepass side by side, in one process.

    PYTHONPATH=. python bench/models.py [--models gpt2,llama,...] [--budget-s 500] [--options '{"graphs": true}']
        [--peers reduce-overhead]

Each model runs through `fusepass.compare` in bf16 with its training step (forward, cross-entropy, backward):
forward and step milliseconds, tokens per second, peak memory and the first call (the compile), each backend in
the same process. The rows (examples/<model>.py's sizes unless a row names its own) are those of the whole-model
issue: GPT-2 small at T 1024 and 4096 (and at 1024 with its loss compiled with the model), Llama-style 1B-shaped
layers at T 8192 (also with its loss compiled), BERT-base at T 512 with padding, T5-base, ViT-B/16, Gemma-2-style at T 8192. A model whose next row would pass `--budget-s` is left for the next
run. Each row runs in a process of its own: a model that fails (a device-side assert ends its process's CUDA
context) costs its row only. Writes bench/results/models-<date>.md and .json.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

from harness import keep

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

# (model, size, batch, sequence, extra arguments)
ROWS = [
    ("gpt2", "small", 8, 1024, []),
    ("gpt2", "small", 2, 4096, []),
    ("gpt2", "small", 8, 1024, ["--loss-compiled"]),  # the loss in the compiled function, as nanoGPT's forward
    ("llama", "small", 1, 8192, []),
    ("llama", "small", 1, 8192, ["--loss-compiled"]),  # as Hugging Face's forward computes the loss from its labels
    ("bert", "small", 8, 512, []),
    ("t5", "small", 8, 512, []),
    ("vit", "small", 32, 224, []),
    ("gemma2", "small", 1, 8192, []),
]
COLUMNS = ["model", "size", "batch", "seq", "backend", "forward ms", "step ms", "tokens/s", "peak GiB",
           "first call s", "output error", "gradient error", "later gradient error", "output vs fp32",
           "gradients vs fp32", "step vs inductor", "forward vs inductor"]


def run_row(name: str, size: str, batch: int, seq: int, extra: list[str], options: str, peers: str) -> list[dict]:
    sys.path.insert(0, EXAMPLES)
    module = importlib.import_module(name)
    argv = ["--size", size, "--train", "--batch", str(batch), "--seq", str(seq), "--options", options,
            "--peers", peers, *extra]
    result = module.main(argv) if hasattr(module, "main") else None
    if result is None:
        raise RuntimeError(f"examples/{name}.py has no main(argv) returning its comparison")
    rows = []
    for r in result.results:
        row = {"model": name + (" " + " ".join(extra) if extra else ""), "size": size, "batch": batch, "seq": seq,
               "backend": r.backend, "forward ms": r.forward_ms, "step ms": r.step_ms, "tokens/s": r.tokens_per_s,
               "peak GiB": r.peak_memory_gib, "first call s": r.first_call_s, "output error": r.output_error,
               "gradient error": r.gradient_error,
               "output vs fp32": r.reference_output_error, "gradients vs fp32": r.reference_gradient_error,
               "later gradient error": r.later_gradient_error}
        if r.backend == "fusepass":
            row["step vs inductor"] = result.speedup("fusepass", "inductor", "step_ms")
            row["forward vs inductor"] = result.speedup("fusepass", "inductor", "forward_ms")
        rows.append(row)
    return rows


def run_in_process(index: int, timeout_s: float, options: str, peers: str) -> list[dict]:
    name, size, batch, seq, extra = ROWS[index]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--row", str(index), "--row-out", out.name,
                                   "--options", options, "--peers", peers],
                                  timeout=timeout_s, capture_output=True, text=True)
            failure = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            failure = f"past {timeout_s:.0f} s"
        if failure is None:
            return json.load(open(out.name))
    print(f"{name} {size} B{batch} T{seq}: {failure}", file=sys.stderr)
    return [{"model": name + (" " + " ".join(extra) if extra else ""), "size": size, "batch": batch, "seq": seq,
             "backend": f"failed: {failure[:160]}"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(dict.fromkeys(r[0] for r in ROWS)))
    parser.add_argument("--budget-s", type=float, default=500)
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # the child process of one row
    parser.add_argument("--row-out", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help="fusepass.backend's options as JSON")
    parser.add_argument("--peers", default="", help="Inductor's modes timed beside its default, e.g. reduce-overhead")
    args = parser.parse_args()
    if args.row is not None:
        json.dump(run_row(*ROWS[args.row], args.options, args.peers), open(args.row_out, "w"))
        return
    chosen = args.models.split(",")
    started, rows, skipped = time.time(), [], []
    for index, (name, size, batch, seq, extra) in enumerate(ROWS):
        if name not in chosen:
            continue
        left = args.budget_s - (time.time() - started)
        if left <= 0:
            skipped.append(f"{name} {size} B{batch} T{seq} {' '.join(extra)}")
            continue
        rows += run_in_process(index, left + 120, args.options, args.peers)  # a row begun within the budget may finish past it
    notes = "bf16, training step = forward + cross-entropy + backward; each backend in the same process."
    if json.loads(args.options):
        notes += f" fusepass's options: {args.options}."
    if args.peers:
        notes += f" Inductor's modes beside its default: {args.peers}."
    if skipped:
        notes += " Not run (time budget): " + "; ".join(skipped) + "."
    print(keep("models", COLUMNS, rows, notes))


if __name__ == "__main__":
    main()
