"""Index expressions over the kernel's coordinates: the flat batch-head index ``f = b·H + h``, the query
position ``q`` and the key position ``k``.

Every coordinate of every value in a score chain is such an expression: a sum of terms
``coef · (var // div % mod)`` plus a constant. Views split and merge coordinates, slices scale and shift
them; the small algebra here keeps the common round trips (``[B·H] → [B, H] → [B·H]``) in their simplest
form, so that the scores are recognised at the coordinates the kernel computes them at and the emitted
code does no needless division.
"""
from __future__ import annotations

from dataclasses import dataclass

VARS = ("f", "q", "k")


@dataclass(frozen=True)
class Term:
    var: str
    div: int
    mod: int | None  # None: unbounded (the var's own range)
    coef: int


@dataclass(frozen=True)
class Idx:
    terms: tuple[Term, ...] = ()
    const: int = 0

    @staticmethod
    def var(name: str) -> "Idx":
        return Idx((Term(name, 1, None, 1),))

    @staticmethod
    def constant(value: int) -> "Idx":
        return Idx((), value)

    @property
    def vars(self) -> frozenset[str]:
        return frozenset(t.var for t in self.terms)

    def is_var(self, name: str, size: int) -> bool:
        """Whether this is just ``name`` (which ranges over ``size``: over one value, 0 is the same)."""
        if size == 1 and self.const == 0 and not self.terms:
            return True
        if self.const != 0 or len(self.terms) != 1:
            return False
        t = self.terms[0]
        return t.var == name and t.div == 1 and t.coef == 1 and (t.mod is None or t.mod >= size)

    def scaled(self, coef: int, shift: int = 0) -> "Idx":
        return _normal(tuple(Term(t.var, t.div, t.mod, t.coef * coef) for t in self.terms),
                       self.const * coef + shift)

    def __add__(self, other: "Idx") -> "Idx":
        return _normal(self.terms + other.terms, self.const + other.const)

    def split(self, sizes: tuple[int, ...]) -> tuple["Idx", ...]:
        """The coordinates of this index in row-major ``sizes`` (it ranges over their product)."""
        if len(sizes) == 1:
            return (self,)
        out = []
        for i, size in enumerate(sizes):
            inner = 1
            for s in sizes[i + 1:]:
                inner *= s
            out.append(Idx.constant(0) if size == 1 else self._div_mod(inner, size))
        return tuple(out)

    def _div_mod(self, div: int, mod: int) -> "Idx":
        if len(self.terms) == 1 and self.const == 0 and self.terms[0].coef == 1:
            t = self.terms[0]
            if t.mod is None or t.mod % div == 0:
                inner_mod = None if t.mod is None else t.mod // div
                new_mod = mod if inner_mod is None or inner_mod % mod == 0 else None
                if new_mod is not None or inner_mod == mod:
                    return Idx((Term(t.var, t.div * div, mod, 1),))
        return Idx((Term(_Opaque(self, div), 1, mod, 1),))

    def render(self, names: dict[str, str]) -> str:
        parts = [_render_term(t, names) for t in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return parts[0] if len(parts) == 1 else "(" + " + ".join(parts) + ")"


@dataclass(frozen=True)
class _Opaque:
    """``inner // div`` for an index the algebra could not simplify."""

    inner: Idx
    div: int


def merge(coords: tuple[Idx, ...], sizes: tuple[int, ...]) -> Idx:
    """The row-major flat index of ``coords`` in ``sizes``."""
    total = Idx.constant(0)
    for i, c in enumerate(coords):
        inner = 1
        for s in sizes[i + 1:]:
            inner *= s
        total = total + c.scaled(inner)
    return total


def _normal(terms: tuple[Term, ...], const: int) -> Idx:
    """Drop zero terms; fuse ``m·(v // (d·n) % m') + (v // d % n)`` pairs back into ``v // d % (n·m')``."""
    terms = [t for t in terms if t.coef != 0]
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(terms):
            for j, b in enumerate(terms):
                if i == j or a.var != b.var or b.mod is None:
                    continue
                if a.div == b.div * b.mod and a.coef == b.coef * b.mod:
                    mod = None if a.mod is None else a.mod * b.mod
                    fused = Term(a.var, b.div, mod, b.coef)
                    terms = [t for k, t in enumerate(terms) if k not in (i, j)] + [fused]
                    changed = True
                    break
            if changed:
                break
    terms.sort(key=lambda t: (str(t.var), t.div))
    return Idx(tuple(terms), const)


def _render_term(t: Term, names: dict[str, str]) -> str:
    if isinstance(t.var, _Opaque):
        base = f"({t.var.inner.render(names)} // {t.var.div})"
    else:
        base = names[t.var]
        if t.div != 1:
            base = f"({base} // {t.div})"
    if t.mod is not None and not (isinstance(t.var, str) and t.div == 1 and names.get(f"{t.var}_range") == t.mod):
        base = f"({base} % {t.mod})"
    return base if t.coef == 1 else f"{t.coef} * {base}"
