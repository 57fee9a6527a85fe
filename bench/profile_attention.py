"""What holds an attention forward back: Nsight Compute's view of fusepass's kernel beside FlexAttention's and
SDPA's (where SDPA can say the case).

    PYTHONPATH=. python bench/profile_attention.py [--cases causal,alibi] [--backward] [--shape B,H,N,D] [--ncu ncu]
                                                   [--out DIR]

For each case of ``bench/attention.py`` (B2 H16 N8192 D128 bf16, or ``--shape B,H,N,D``) the script runs itself under
``ncu --clock-control none --profile-from-start off``: the child compiles the case with fusepass (its own
kernels: the SDPA floor off) and with FlexAttention, runs each (and SDPA) once to compile and fill every cache,
then runs one forward of each between ``cudaProfilerStart`` and ``cudaProfilerStop`` (with ``--backward``, one
forward and backward of each, every input of the case that can take a gradient needing one). Kept per kernel:
duration, issue-slot and pipe utilization (tensor, FMA, ALU, XU: the special-function unit exp2 runs on; L1 and
shared memory), registers, occupancy and the top warp stall reasons. Small kernels (block maps) are left out. Writes ncu's full details beside the table.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

import torch
from harness import RESULTS, keep

SHAPE = "2,16,8192,128"
METRICS = {
    "gpu__time_duration.sum": "µs",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor %",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "lsu %",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1/shared %",
    "smsp__inst_executed_op_local_ld.sum": "local loads",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active": "fma %",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active": "alu %",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu %",
    "smsp__inst_executed.sum": "instructions",
    "launch__registers_per_thread": "registers",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "stall barrier",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "stall long sb",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "stall math",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "stall wait",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio": "stall short sb",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio": "stall mio",
    "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio": "stall lg",
    "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio": "stall membar",
    "smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio": "stall dispatch",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
}
MIN_DURATION_US = 50.0


def child(case_name: str, backward: bool, shape: str) -> None:
    from attention import CASES
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import fusepass

    case = CASES[case_name]
    b, h, n, d = map(int, shape.split(","))
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    extra = case.extra(b, h, n, "cuda")
    if not backward:
        extra = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in extra)
    fused = torch.compile(case.fn, backend=fusepass.backend(strict=True, sdpa=False, graphs=False))  # its own kernels
    score_mod, mask_mod = case.flex(b, h, n, *extra)
    block_mask = create_block_mask(mask_mod, b, h, n, n, device="cuda") if mask_mod else None
    flex = torch.compile(flex_attention)
    calls = [lambda: fused(q, k, v, *extra),
             lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=case.flex_scale)]
    if case.sdpa is not None:
        calls.append(lambda: case.sdpa(q, k, v, *extra))
    grad = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    runs = [(lambda call=call: call().backward(grad)) if backward else call for call in calls]
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(case_name: str, backward: bool, shape: str, ncu: str, out_dir: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--metrics",
               ",".join(METRICS), sys.executable, os.path.abspath(__file__), "--child", case_name, "--shape", shape,
               *(["--backward"] if backward else [])]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    what = f"{case_name}-fwd-bwd" if backward else case_name
    what += "" if shape == SHAPE else "-" + shape.replace(",", "-")
    with open(os.path.join(out_dir, f"ncu-attention-{what}.log"), "w") as f:
        f.write(result.stdout + result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith('"')]
    by_kernel: dict[tuple[str, str], dict] = {}
    for record in csv.DictReader(io.StringIO("\n".join(lines))):
        key = (record["ID"], record["Kernel Name"])
        row = by_kernel.setdefault(key, {"case": what, "kernel": record["Kernel Name"][:40]})
        name = record["Metric Name"]
        if name in METRICS and record["Metric Value"] != "n/a":  # not every metric exists on every GPU
            value = float(record["Metric Value"].replace(",", ""))
            if name == "gpu__time_duration.sum":
                value *= {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(record["Metric Unit"], 1.0)
            row[METRICS[name]] = value
    return [row for row in by_kernel.values() if row.get("µs", 0.0) >= MIN_DURATION_US]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="causal,alibi")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--shape", default=SHAPE, help="B,H,N,D")
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--out", default=RESULTS, help="where ncu's raw output goes")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.backward, args.shape)
        return
    rows = [row for case in args.cases.split(",") for row in profile(case, args.backward, args.shape, args.ncu,
                                                                                   args.out)]
    print(keep("profile-attention", ["case", "kernel", *METRICS.values()], rows))


if __name__ == "__main__":
    main()
