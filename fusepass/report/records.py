"""What every pass appends to a compile's report: one record per rewrite and per thing left unfused.

The records are the single source of truth: the ledger (``ledger.py``) fills their bytes and flops, the
roofline (``roofline.py``) their time estimates, the profiler (``profile.py``) their measured times, and
every view (table, JSON, HTML) only reads them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


# A rewrite's detail: the buffers whose contents its kernels compute in place of reading them (an attention's
# tril mask), each by the user's name, with what it holds.
KNOWN_CONTENTS = "known contents"
# An attention's: per shape it ran at on the GPU, whether SDPA or the fused kernels ran, with both measured times
# (`attention.sdpa_floor`).
SDPA = "sdpa"
# An attention's, in each phase's record: per shape, the kernel that ran where it is not the Triton kernel
# (`flash.hopper_forward`, `flash.hopper_backward`).
KERNEL = "sm_90 kernel"


@dataclass
class Rewrite:
    """A group of ATen ops replaced by one fused kernel, in one phase (forward or backward)."""

    kind: str  # "attention" | "elementwise" | "reduction" (an elementwise group holding row reductions)
    phase: str  # "forward" | "backward"
    location: str  # the user's file:line
    ops: tuple[str, ...]  # ATen ops replaced, in the order they run
    bytes_unfused: int  # HBM bytes the replaced ops move as separate kernels
    bytes_fused: int  # HBM bytes the fused kernel moves, under its tiling model
    bytes_ideal: int = 0  # each input read once, each output written once: the floor of any kernel
    flops: int = 0  # floating-point operations of the replaced ops
    flops_fused: int = 0  # those the fused kernel performs (skipped tiles, recomputation)
    activation_bytes_saved: int = 0  # bytes no longer kept from the forward for the backward
    features: tuple[str, ...] = ()
    time_unfused_ms: float | None = None  # roofline estimates, filled by roofline.estimate
    time_fused_ms: float | None = None
    measured_unfused_ms: float | None = None  # FUSEPASS_PROFILE=1 on CUDA: the first call, timed
    measured_fused_ms: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # the model's inputs: shapes, tiles, density

    @property
    def bytes_saved(self) -> int:
        return self.bytes_unfused - self.bytes_fused

    @property
    def intensity_unfused(self) -> float | None:
        """FLOP per HBM byte of the replaced ops."""
        return _ratio(self.flops, self.bytes_unfused)

    @property
    def intensity_fused(self) -> float | None:
        return _ratio(self.flops_fused, self.bytes_fused)

    @property
    def measured_speedup(self) -> float | None:
        if self.measured_unfused_ms is None or self.measured_fused_ms is None:
            return None
        return _ratio(self.measured_unfused_ms, self.measured_fused_ms)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ops": list(self.ops), "features": list(self.features),
                "bytes_saved": self.bytes_saved, "intensity_unfused": self.intensity_unfused,
                "intensity_fused": self.intensity_fused, "measured_speedup": self.measured_speedup}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Rewrite":
        return cls(**{**_own_fields(cls, data), "ops": tuple(data["ops"]), "features": tuple(data["features"])})


@dataclass
class Hotspot:
    """Something left unfused, why, and what it costs."""

    kind: str  # "attention" | "elementwise" | "intermediate" | "fallback" | "matmul" | "aten" (an op left to ATen)
    phase: str
    location: str
    reason: str
    ops: tuple[str, ...] = ()
    bytes: int = 0  # estimated HBM bytes the unfused ops move
    flops: int = 0
    time_ms: float | None = None  # roofline estimate, filled by roofline.estimate

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ops": list(self.ops)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Hotspot":
        return cls(**{**_own_fields(cls, data), "ops": tuple(data["ops"])})


def _own_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The stored fields of ``data`` (its derived entries, such as ``bytes_saved``, are recomputed)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}
