"""The device's ceilings and the roofline time estimate of every record.

A kernel takes at least max(flops / peak FLOP/s, bytes / HBM bandwidth). The ceilings default to those we
measured on an H200 (a device copy, bytes read + written; an 8192³ bf16 matmul); give others with
``fusepass.set_ceilings(Ceilings(...))`` or measure the current CUDA device with
``fusepass.set_ceilings(measure_ceilings())``. A report keeps the ceilings it was estimated with.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fusepass.report.report import Report


@dataclass(frozen=True)
class Ceilings:
    name: str  # what the figures are of
    hbm_bytes_per_s: float  # bytes read + written per second
    flops_per_s: float  # 16-bit tensor-core matmul (fp32 kernels run below it: their estimates are a floor)
    sms: int  # streaming multiprocessors: the programs in flight of the attention tiling model
    source: str = "given"  # "default" | "given" | "measured"

    def __post_init__(self) -> None:
        for name in ("hbm_bytes_per_s", "flops_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"Ceilings.{name} must be a positive finite number, not {value!r}")
        if not (isinstance(self.sms, int) and self.sms > 0):
            raise ValueError(f"Ceilings.sms must be a positive int, not {self.sms!r}")

    @property
    def ridge(self) -> float:
        """The arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
        return self.flops_per_s / self.hbm_bytes_per_s

    def time_ms(self, flops: float, bytes: float) -> float:
        return 1e3 * max(flops / self.flops_per_s, bytes / self.hbm_bytes_per_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# PEERS.md: one H200, torch 2.11, 2026-11-29 — copy 3.67 TB/s, bf16 matmul 685 TFLOP/s.
H200 = Ceilings("NVIDIA H200 (measured copy and bf16 matmul)", 3.67e12, 685e12, 132, "default")

_given: Ceilings | None = None


def set_ceilings(ceilings: Ceilings | None) -> None:
    """The ceilings of reports compiled from now on (None: back to the H200 default)."""
    global _given
    _given = ceilings


def current_ceilings() -> Ceilings:
    return _given or H200


def measure_ceilings(device: torch.device | str | None = None) -> Ceilings:
    """The current CUDA device's ceilings, measured as PEERS.md did: a 1 GiB device copy and an 8192³ bf16
    matmul, medians of ``triton.testing.do_bench``."""
    import triton.testing

    device = torch.device(device or "cuda")
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    matmul_ms = triton.testing.do_bench(lambda: a @ a, return_mode="median")
    return Ceilings(f"{torch.cuda.get_device_name(device)} (measured copy and bf16 matmul)",
                    2 * x.numel() * x.element_size() / (copy_ms * 1e-3), 2 * 8192**3 / (matmul_ms * 1e-3),
                    torch.cuda.get_device_properties(device).multi_processor_count, "measured")


def estimate(report: Report) -> None:
    """Give every record of ``report`` that has none its roofline time, with the report's ceilings."""
    ceilings = report.ceilings
    for r in report.rewrites:
        if r.time_unfused_ms is None:
            r.time_unfused_ms = ceilings.time_ms(r.flops, r.bytes_unfused)
            r.time_fused_ms = ceilings.time_ms(r.flops_fused, r.bytes_fused)
    for h in report.hotspots:
        if h.time_ms is None:
            h.time_ms = ceilings.time_ms(h.flops, h.bytes)
