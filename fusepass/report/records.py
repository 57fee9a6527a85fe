"""What every pass appends to a compile's report: one record per rewrite and per thing left unfused."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Rewrite:
    """A group of ATen ops replaced by one fused kernel."""

    kind: str  # "attention" | "elementwise"
    phase: str  # "forward" | "backward"
    location: str  # the user's file:line
    ops: tuple[str, ...]  # ATen ops replaced, in graph order
    bytes_unfused: int  # HBM bytes the replaced ops move as separate kernels
    bytes_fused: int  # HBM bytes the fused kernel moves
    flops: int = 0
    features: tuple[str, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_unfused - self.bytes_fused

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ops": list(self.ops), "features": list(self.features),
                "bytes_saved": self.bytes_saved}


@dataclass
class Hotspot:
    """Something left unfused, why, and what it costs in HBM traffic."""

    kind: str  # "attention" | "elementwise" | "fallback"
    phase: str
    location: str
    reason: str
    ops: tuple[str, ...] = ()
    bytes: int = 0  # estimated HBM bytes the unfused ops move

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ops": list(self.ops)}
