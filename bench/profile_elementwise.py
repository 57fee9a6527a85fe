"""Which kernels one step of an elementwise case runs, and for how long, under Inductor and fusepass.

    PYTHONPATH=. python bench/profile_elementwise.py [--cases "gelu-bias fwd+bwd"] [--log2 26]

Runs each named case of ``bench/elementwise.py`` warm under both backends, profiles five steps with
torch.profiler and prints each backend's kernels by device time, then the wall time per step: a row of the
elementwise suite that trails Inductor is explained by a kernel it runs that Inductor's does not, or by a
kernel slower than its bytes say.
"""
from __future__ import annotations

import argparse

import torch
from elementwise import CASES
from harness import kernels_by_device_time, median_ms

import fusepass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gelu-bias fwd+bwd")
    parser.add_argument("--log2", type=int, default=26, help="log2 of the element count")
    args = parser.parse_args()
    by_name = {case.name: case for case in CASES}
    for name in args.cases.split(","):
        case = by_name[name]
        inputs = case.make(1 << args.log2)
        grad = torch.randn_like(case.fn(*inputs))
        for backend in ("inductor", fusepass.backend(strict=True, graphs=False)):
            torch._dynamo.reset()
            compiled = torch.compile(case.fn, backend=backend)

            def step():
                out = compiled(*inputs)
                return torch.autograd.grad(out, inputs, grad) if case.backward else out

            step()
            ms = median_ms(step)
            label = backend if isinstance(backend, str) else "fusepass"
            print(f"== {name} under {label}: {ms:.3f} ms per step (median)")
            print(kernels_by_device_time(step, steps=5, rows=10, width=70))


if __name__ == "__main__":
    main()
