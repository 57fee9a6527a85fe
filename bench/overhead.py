"""Host overhead and compile time: fusepass against Inductor.

    PYTHONPATH=. python bench/overhead.py

- per call: a compiled 10-op pointwise graph on a small tensor (the GPU work is negligible, so the time is
  what the host spends launching), the median of many calls, CUDA-synchronised;
- compile time: the first call of each example model's function, compiled afresh.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from harness import keep

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import alibi  # noqa: E402
import causal_attention  # noqa: E402
import elementwise_chain  # noqa: E402

import fusepass  # noqa: E402


def ten_ops(x):
    for _ in range(5):
        x = torch.sigmoid(x * 1.5) + 0.25
    return x


def per_call_us(fn, *args, calls: int = 2000) -> float:
    fn(*args)
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def compile_seconds(fn, *args, backend) -> float:
    torch._dynamo.reset()
    start = time.perf_counter()
    torch.compile(fn, backend=backend)(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    rows = []
    x = torch.randn(256, device="cuda")
    for name, backend in (("inductor", "inductor"), ("fusepass", fusepass.backend(strict=True, graphs=False))):
        torch._dynamo.reset()
        compiled = torch.compile(ten_ops, backend=backend)
        rows.append({"what": "10-op graph, 256 elements: host µs per call", "backend": name,
                     "value": per_call_us(compiled, x)})
    q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / 16) for i in range(16)], device="cuda")
    xs = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    bs = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    models = {"causal attention": (causal_attention.causal_attention, (q, k, v)),
              "ALiBi attention": (alibi.alibi_attention, (q, k, v, slopes)),
              "elementwise chain": (elementwise_chain.chain, (xs, bs))}
    for model, (fn, args) in models.items():
        for name, backend in (("inductor", "inductor"), ("fusepass", fusepass.backend(strict=True, graphs=False))):
            rows.append({"what": f"{model}: compile s (first call)", "backend": name,
                         "value": compile_seconds(fn, *args, backend=backend)})
    for row in rows:
        print(row, flush=True)
    print(keep("overhead", ["what", "backend", "value"], rows))


if __name__ == "__main__":
    main()
