"""A long fuzzing campaign: random pointwise programs and random attention programs, forward and backward against
eager (float64 where eager is itself approximate), counted.

    python scripts/fuzz.py [--pointwise 10000] [--attention 1000] [--workers 2] [--out bench/results/fuzz-DATE.md]

It draws from the generators the tests use (tests/elementwise/test_random_training.py, tests/attention/
test_random_attention.py), at this budget instead of CI's, with new examples every run, and runs each program
without stopping at the first failure: a program is exact (and fused, or declined with its reason), or it is
counted wrong, with its program. Kernels run through Triton's interpreter where there is no GPU. The counts go to
the markdown file (`--out`), with the date, machine and versions.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import multiprocessing
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    for path in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "attention"),
                 os.path.join(ROOT, "tests", "elementwise")):
        if path not in sys.path:
            sys.path.insert(0, path)
    if os.environ.get("TRITON_INTERPRET") == "1":
        from interpreter_rounding import round_to_nearest

        round_to_nearest()  # as the tests convert to bf16: as the GPU does


def _outcome(run) -> tuple[str, str]:
    """("exact", reason or "") or ("wrong", what), of one program."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = run()
        except Exception as error:  # noqa: BLE001 - every failure is counted, none ends the campaign
            return "wrong", f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    fell_back = [str(w.message) for w in caught if "running it unfused" in str(w.message)]
    if fell_back:
        return "kernel failure", fell_back[0][:300]
    declined = sorted({h.reason.split(":")[0] for h in report.hotspots if h.kind == "attention"})
    return "exact", "; ".join(declined)


def _pointwise_worker(count: int, queue) -> None:
    _setup()
    import torch
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from test_random_training import DTYPES, LAYOUTS, build, layout_input, rows_walked, steps

    from support import check

    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(program=steps, layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=2),
           dtypes=st.lists(st.sampled_from(DTYPES), min_size=2, max_size=3), walked=st.booleans(),
           value_seed=st.integers(0, 2**31))
    def one(program, layouts, dtypes, walked, value_seed):
        def run():
            torch.manual_seed(value_seed)
            torch._dynamo.reset()
            inputs = [layout_input("contiguous", dtypes[0])] + [
                layout_input(layout, dtype) for layout, dtype in zip(layouts, dtypes[1:])]
            with rows_walked(walked):
                return check(build(program, len(inputs)), *inputs, backward=True)

        queue.put(("pointwise", *_outcome(run), repr((program, layouts, dtypes, walked, value_seed))))

    one()


def _attention_worker(count: int, queue) -> None:
    _setup()
    from hypothesis import HealthCheck, Phase, given, settings
    from test_random_attention import programs, run_program

    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(p=programs())
    def one(p):
        queue.put(("attention", *_outcome(lambda: run_program(p)), repr(p)))

    one()


def _versions() -> str:
    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores), " \
        "Triton's interpreter"
    return f"{device}; torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pointwise", type=int, default=10000)
    parser.add_argument("--attention", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    out = args.out or os.path.join(ROOT, "bench", "results", f"fuzz-{stamp}.md")

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    jobs = []
    for kind, total, worker in (("pointwise", args.pointwise, _pointwise_worker),
                                ("attention", args.attention, _attention_worker)):
        share = [total // args.workers + (i < total % args.workers) for i in range(args.workers)]
        jobs += [(worker, n) for n in share if n]
    started = time.time()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    declines: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    wrong: list[str] = []
    examples: dict[tuple[str, str], str] = {}  # a program of each outcome
    expected = args.pointwise + args.attention
    pending = list(jobs)
    running: list = []
    seen = 0
    while pending or running or seen < expected:
        while pending and len(running) < args.workers:
            worker, n = pending.pop(0)
            process = context.Process(target=worker, args=(n, queue))
            process.start()
            running.append(process)
        try:
            kind, outcome, detail, program = queue.get(timeout=5)
        except Exception:  # noqa: BLE001 - the queue's Empty: look at the workers
            running = [p for p in running if p.is_alive() or p.exitcode is None]
            if not running and not pending:
                break
            continue
        seen += 1
        counts[kind][outcome] += 1
        if outcome == "exact":
            declines[kind][detail or "fused"] += 1
            examples.setdefault((kind, detail), program)
        else:
            wrong.append(f"- {kind}, {outcome}: {detail}\n  `{program}`")
            print(wrong[-1], flush=True)  # at once: a campaign stopped early keeps its programs in its log
        if seen % 100 == 0:
            print(f"{seen} programs, {time.time() - started:.0f} s: {dict(counts['pointwise'])} "
                  f"{dict(counts['attention'])}", flush=True)
    lines = [f"# Fuzzing campaign, {stamp}", "", _versions(), "",
             f"`python scripts/fuzz.py --pointwise {args.pointwise} --attention {args.attention}`, "
             f"{time.time() - started:.0f} s.", "",
             "| programs | run | exact | wrong | kernel failures |", "|---|---|---|---|---|"]
    for kind in ("pointwise", "attention"):
        c = counts[kind]
        lines.append(f"| {kind} | {sum(c.values())} | {c['exact']} | {c['wrong']} | {c['kernel failure']} |")
    lines += ["", "Attention programs by outcome (declined ones by their reason):", ""]
    for reason, n in declines["attention"].most_common():
        lines.append(f"- {reason}: {n}" + ("" if reason == "fused" else f", e.g. `{examples['attention', reason]}`"))
    lines += ["", "Wrong results and kernel failures:", ""] + (wrong or ["none"])
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
