"""The ledger against the hardware: DRAM bytes of fusepass's kernels, measured with Nsight Compute.

    PYTHONPATH=. python bench/ncu_bytes.py [--cases plain,causal,bias,chain] [--ncu ncu]

For each case the script runs itself under ``ncu --clock-control none --profile-from-start off`` with the
metrics ``dram__bytes_read.sum`` and ``dram__bytes_write.sum``. The child compiles the case with fusepass,
runs it once to compile every kernel and fill every cache, then runs it once more between
``cudaProfilerStart`` and ``cudaProfilerStop``: only that step is profiled. It writes its report as JSON
beside ncu's CSV. The parent sums the measured bytes by kernel name and puts them beside the ledger's
``detail["bytes_fused_by_kernel"]`` (the tiling model, docs/report.md) and ``bytes_ideal`` of the same
records. A measurement between ideal and fused says the model is an upper bound that holds; above fused,
the model misses traffic; far below it, L2 serves more re-reads than the model assumes.

Needs a CUDA GPU with Nsight Compute (``ncu`` on PATH, or --ncu), and permission to read the performance
counters. First run: bench/results/ncu-bytes-2026-11-29-2201.md (cases chain and plain).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from harness import keep

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def causal(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def dense_bias(q, k, v, bias):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def chain(x, b):
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


def _qkv(b: int, h: int, n: int, d: int, dtype: torch.dtype, grad: bool) -> list[torch.Tensor]:
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3)]


# name → (what it is, the function, its inputs, whether it runs the backward too)
CASES: dict[str, tuple[str, Callable, Callable[[], list[torch.Tensor]], bool]] = {
    "plain": ("plain attention, fp16 B1 H16 N4096 D128, forward", plain,
              lambda: _qkv(1, 16, 4096, 128, torch.float16, False), False),
    "causal": ("causal attention, bf16 B2 H16 N8192 D128, forward + backward", causal,
               lambda: _qkv(2, 16, 8192, 128, torch.bfloat16, True), True),
    "bias": ("dense bias [1, H, N, N], fp16 B1 H16 N2048 D64, forward + backward", dense_bias,
             lambda: _qkv(1, 16, 2048, 64, torch.float16, True)
             + [torch.randn(1, 16, 2048, 2048, device="cuda", dtype=torch.float16)], True),
    "chain": ("gelu(x*0.5 + b) * sigmoid(x), bf16 8192×8192, forward", chain,
              lambda: [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16),
                       torch.randn(8192, device="cuda", dtype=torch.bfloat16)], False),
}


def child(case: str, report_path: str) -> None:
    """Runs under ncu: compile and warm up, then one profiled step; the report goes to ``report_path``."""
    import fusepass

    _, fn, make_inputs, backward = CASES[case]
    compiled = torch.compile(fn, backend=fusepass.backend(graphs=False))
    inputs = make_inputs()

    def step() -> None:
        out = compiled(*inputs)
        if backward:
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()

    step()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.cudart().cudaProfilerStop()
    with open(report_path, "w") as f:
        json.dump([r.to_dict() for r in fusepass.reports()], f)


def measured_bytes(csv_path: str) -> dict[str, float]:
    """DRAM bytes read + written, summed by kernel name, from ncu's CSV (base units)."""
    by_kernel: dict[str, float] = defaultdict(float)
    with open(csv_path) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV
    for row in csv.DictReader(lines):
        if row["Metric Name"] in METRICS:
            by_kernel[row["Kernel Name"].split("(")[0].strip()] += float(row["Metric Value"].replace(",", ""))
    return by_kernel


def _matching(by_kernel: dict[str, float], name: str) -> float | None:
    found = [b for kernel, b in by_kernel.items() if kernel == name or kernel.startswith(name + "_")]
    return sum(found) if found else None


def run_case(case: str, ncu: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        report_path, csv_path = os.path.join(folder, "report.json"), os.path.join(folder, "ncu.csv")
        command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics", ",".join(METRICS),
                   "--csv", "--print-units", "base", "--log-file", csv_path,
                   sys.executable, os.path.abspath(__file__), "--child", case, "--report", report_path]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        by_kernel = measured_bytes(csv_path)
        with open(report_path) as f:
            reports = json.load(f)
    rows, attributed = [], set()
    for report in reports:
        for r in report["rewrites"]:
            parts = r["detail"].get("bytes_fused_by_kernel") or {r["detail"].get("kernel", "?"): r["bytes_fused"]}
            for kernel, model in parts.items():
                measured = _matching(by_kernel, kernel)
                attributed.update(k for k in by_kernel if k == kernel or k.startswith(kernel + "_"))
                rows.append({"case": case, "record": f"{r['kind']} {r['phase']}", "kernel": kernel,
                             "measured MB": measured / 1e6 if measured is not None else "-",
                             "model MB": model / 1e6, "ideal MB (record)": r["bytes_ideal"] / 1e6,
                             "unfused MB (record)": r["bytes_unfused"] / 1e6,
                             "measured / model": measured / model if measured and model else "-"})
    others = sum(b for k, b in by_kernel.items() if k not in attributed)
    rows.append({"case": case, "record": "-", "kernel": "other kernels in the step", "measured MB": others / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--child")
    parser.add_argument("--report")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.report)
        return
    rows = [row for case in args.cases.split(",") for row in run_case(case, args.ncu)]
    notes = "\n".join(f"- {name}: {CASES[name][0]}" for name in args.cases.split(",")) + (
        "\n\nDRAM bytes read + written (ncu --clock-control none), against the ledger's tiling model "
        "(docs/report.md). Kernels other than fusepass's in the profiled step are summed in the last row "
        "of each case.")
    print(keep("ncu-bytes", ["case", "record", "kernel", "measured MB", "model MB", "ideal MB (record)",
                             "unfused MB (record)", "measured / model"], rows, notes))


if __name__ == "__main__":
    main()
