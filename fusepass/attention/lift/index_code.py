"""Index code: the statements that compute the chain's values no gradient flows through (positions, masks, loads
of mask tensors, gathers), one name each, and the jit functions that read them."""
from __future__ import annotations

import re

from fusepass.codegen.operands import Emitter


class IndexCode(Emitter):
    def __init__(self) -> None:
        super().__init__(prefix="i")

    def closure(self, expr: str) -> list[str]:
        """The statements of index code the expression `expr` reads, directly or not, in their order."""
        definitions = dict(line.split(" = ", 1) for line in self.lines)
        pending, seen = [expr], set()
        while pending:
            for name in re.findall(rf"\b{self.prefix}\d+\b", pending.pop()):
                if name in definitions and name not in seen:
                    seen.add(name)
                    pending.append(definitions[name])
        return [line for line in self.lines if line.split(" = ", 1)[0] in seen]

    def reads_aux(self, expr: str) -> bool:
        """Whether the index expression `expr` loads from an aux tensor, itself or through the names it uses.
        (A KEEP that does not is evaluated once per shape: its block map is cached.)"""
        return any("aux[" in text for text in [expr, *self.closure(expr)])

    def function(self, name: str, params: str, lines: list[str], ret: str) -> str:
        """A jit function of `lines` and `ret`, after the statements of index code they read (only those: a
        value read from a distance table leaves its own code unread)."""
        return jit_function(name, params, self.closure("\n".join(lines + [ret])) + lines, ret)


def jit_function(name: str, params: str, lines: list[str], ret: str) -> str:
    body = "\n".join(f"    {line}" for line in lines + [ret])
    return f"@triton.jit\ndef {name}({params}):\n{body}\n"


def load_text(aux: int | str, offset: str, mask: str | None) -> str:
    """Code loading aux tensor `aux` at `offset` (0 where `mask` is false)."""
    return f"tl.load(aux[{aux}] + {offset}" + (f", mask={mask}, other=0)" if mask else ")")
