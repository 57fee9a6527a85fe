"""What every benchmark shares: the machine it ran on, median timings, and the results it keeps.

Timings are medians of ``triton.testing.do_bench`` after warm-up, on fresh random data. Each suite writes
``bench/results/<suite>-<date>.json`` (every figure, with the environment) and a markdown table beside it,
and prints the table last.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def environment() -> dict[str, Any]:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.date().isoformat(),
        "time": now.strftime("%H%M"),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def median_ms(fn: Callable[[], Any], warmup_ms: int = 50, rep_ms: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def fastest_batch_s(fn: Callable[[], Any], calls: int, batches: int) -> float:
    """Host seconds a call of ``fn`` takes, from the fastest of `batches` batches of `calls` calls (a shared
    machine's neighbours only ever add)."""
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def device_ms(fn: Callable[[], Any], calls: int = 10) -> float:
    """Kernel time a call of ``fn`` takes on the device (its kernels' durations summed, torch.profiler), without
    the host's time between them: what a call costs where the host keeps ahead."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in trace.events() if e.device_type.name == "CUDA"]
    return sum(e.time_range.elapsed_us() for e in kernels) / calls / 1e3


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """‖got − expected‖ / ‖expected‖, in float32."""
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def kernels_by_device_time(step: Callable[[], Any], steps: int, rows: int, width: int = 90) -> str:
    """The kernels `steps` calls of `step` run, by device time (torch.profiler's table, `rows` of them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=width)


def peak_memory_gib(fn: Callable[[], Any]) -> float:
    """Peak device memory allocated while ``fn`` runs, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def markdown_table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def keep(suite: str, columns: Sequence[str], rows: Sequence[dict[str, Any]], notes: str = "") -> str:
    """Write the suite's results into bench/results (and into $OUT when set) and return the table."""
    env = environment()
    table = markdown_table(columns, rows)
    header = (f"# {suite}\n\n{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
              f"CUDA {env['cuda']}\n\n{notes}\n\n" if notes else
              f"# {suite}\n\n{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
              f"CUDA {env['cuda']}\n\n")
    stem = f"{suite}-{env['date']}-{env['time']}"
    for folder in filter(None, (RESULTS, os.environ.get("OUT"))):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, stem + ".json"), "w") as f:
            json.dump({"suite": suite, "environment": env, "rows": list(rows)}, f, indent=1)
        with open(os.path.join(folder, stem + ".md"), "w") as f:
            f.write(header + table + "\n")
    return table
