"""Which record each op of a compiled graph runs for, so that measured kernel time can be given to it.

The passes tag the nodes they leave with their record (`tag`): a fused kernel's call with its rewrite, an
ATen op with its hotspot. An attention op is found by its name (its records are the call's). With the
``annotate`` option the runnable graph calls each op inside a ``torch.profiler`` range named by `label`, and
`target_of` turns a range's name back into what it ran for: host time on every call, which
``fusepass.profile`` alone asks for.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fusepass.report.ledger import moves_no_bytes
from fusepass.report.records import Hotspot, Rewrite
from fusepass.source import location

RECORD = "fusepass_record"
PREFIX = "fusepass#"


def tag(node: torch.fx.Node, record: Rewrite | Hotspot) -> None:
    node.meta[RECORD] = record


@dataclass(frozen=True)
class Target:
    """What one range's kernels ran for: a record, or (`record` None) an op no record names."""

    record: Rewrite | Hotspot | None
    op: str
    location: str
    phase: str


_targets: dict[str, Target] = {}
_numbers = itertools.count()


def target_of(range_name: str) -> Target | None:
    return _targets.get(range_name)


class _Ranged:
    """A graph op called inside a profiler range."""

    def __init__(self, target: Callable[..., Any], name: str) -> None:
        self.target, self.name = target, name
        self.__name__ = "ranged"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(self.name):
            return self.target(*args, **kwargs)


def _op(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target.overloadpacket.__name__}"
    return getattr(target, "name", None) or getattr(target, "__name__", type(target).__name__)


def annotate(graph: torch.fx.Graph, phase: str, record_of: Callable[[torch.fx.Node], Rewrite | Hotspot | None]
             ) -> None:
    """Call every op of `graph` that moves bytes inside a range naming what it runs for (`record_of` gives
    the record of a node the passes could not tag)."""
    for node in graph.nodes:
        if node.op != "call_function" or moves_no_bytes(node):
            continue
        name = f"{PREFIX}{next(_numbers)}"
        _targets[name] = Target(node.meta.get(RECORD) or record_of(node), _op(node), location(node), phase)
        node.target = _Ranged(node.target, name)
