"""The user's source line behind an FX node, read from the stack trace Dynamo recorded."""
from __future__ import annotations

import os
import re
from collections.abc import Iterable

import torch.fx

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def location(node: torch.fx.Node) -> str:
    """``file:line`` of the innermost user frame that produced ``node``, or ``"?"``."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return "?"
    path, line = frames[-1]
    return f"{_short(path)}:{line}"


def keep_location(node: torch.fx.Node, source: torch.fx.Node) -> None:
    """Give ``node`` the stack trace of ``source``, where it has one. Code Dynamo found no source for (a
    ``python -c`` string) has none, and a stack trace of None breaks AOTAutograd's tracing of the backward,
    which joins the traces of the nodes it runs as strings."""
    if source.meta.get("stack_trace") is not None:
        node.meta["stack_trace"] = source.meta["stack_trace"]


def first_location(nodes: Iterable[torch.fx.Node]) -> str:
    """The first known location among ``nodes`` (a group's location is that of its first op)."""
    for node in nodes:
        where = location(node)
        if where != "?":
            return where
    return "?"


def _short(path: str) -> str:
    """Paths under the working directory relative to it, others by file name: stable across machines."""
    cwd = os.getcwd()
    if path.startswith(cwd + os.sep):
        return os.path.relpath(path, cwd)
    return os.path.basename(path)
