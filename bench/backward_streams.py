"""The backward's two kernels (dQ, then dK/dV) launched one after the other, as the product does, against the
same launches on two streams, where each kernel's last wave of programs can run beside the other's: how much
of the backward is the two kernels' tails. B2 H16 N8192 D128, bf16, with flash_config's tiles.

    PYTHONPATH=. python bench/backward_streams.py [--cases plain,causal,document,document-kv4,window-kv4,packed]

The dK/dV kernel reads delta, which the dQ kernel writes: both are launched once in order first, so that the
concurrent launches read the delta of the same inputs (each launch writes the same values again). A timing of
the launch order only: the product launches them in order.
"""
from __future__ import annotations

import argparse

import torch
from flash_sweep import CAUSAL, PACKED, PLAIN
from harness import keep, median_ms
from kernel_resources import DOCUMENT, WINDOW

from fusepass.flash import backward as flash_bwd, forward as flash_fwd

CASES = {"plain": (PLAIN, 16), "causal": (CAUSAL, 16), "document": (DOCUMENT, 16), "document-kv4": (DOCUMENT, 4),
         "window-kv4": (WINDOW, 4), "packed": (PACKED, 16)}


def recorded_launches(fn) -> list[tuple]:
    """The (kernel, grid, args, keywords) of every flash_bwd launch `fn` makes, launched as they are recorded."""
    launches = []
    launch_fitting = flash_bwd.launch_fitting

    def record(kernel, grid, *args, **keywords):
        launches.append((kernel, grid, args, keywords))
        launch_fitting(kernel, grid, *args, **keywords)

    flash_bwd.launch_fitting = record
    try:
        fn()
    finally:
        flash_bwd.launch_fitting = launch_fitting
    return launches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    b, h, n, d = 2, 16, 8192, 128
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    for name in args.cases.split(","):
        mod, kv_heads = CASES[name]
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        aux = ()
        if mod.keep_reads_aux:
            ids = torch.sort(torch.randint(0, 8, (b, n), device="cuda"), dim=-1).values
            aux = (ids, ids.stride(0))
        out, lse, extra = flash_fwd.flash_attention_forward(q, k, v, mod, aux)
        launches = recorded_launches(lambda: flash_bwd.flash_attention_backward(do, q, k, v, out, lse, extra, mod,
                                                                               aux, None))
        kernels = [launch for launch in launches if launch[0].fn.__name__.startswith("_flash_backward")]
        assert len(kernels) == 2, [launch[0].fn.__name__ for launch in launches]

        def in_order():
            for kernel, grid, args_, keywords in kernels:
                flash_bwd.launch_fitting(kernel, grid, *args_, **keywords)

        def side_by_side():
            current = torch.cuda.current_stream()
            for stream, (kernel, grid, args_, keywords) in zip(streams, kernels):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    flash_bwd.launch_fitting(kernel, grid, *args_, **keywords)
            for stream in streams:
                current.wait_stream(stream)

        def alone(index):
            kernel, grid, args_, keywords = kernels[index]
            return lambda: flash_bwd.launch_fitting(kernel, grid, *args_, **keywords)

        row = {"case": name, "in order ms": median_ms(in_order), "side by side ms": median_ms(side_by_side),
               "dQ alone ms": median_ms(alone(0)), "dK/dV alone ms": median_ms(alone(1))}
        row["saved"] = 1 - row["side by side ms"] / row["in order ms"]
        rows.append(row)
        print(row, flush=True)
    print(keep("backward-streams", ["case", "in order ms", "side by side ms", "dQ alone ms", "dK/dV alone ms",
                                    "saved"], rows))


if __name__ == "__main__":
    main()
