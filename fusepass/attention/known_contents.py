"""Tensors whose contents the graph's compile can read: a module's buffers (nanoGPT's ``tril`` mask), read by the score
chain as the band they hold, and guarded on every call.

A mask read from a tensor is loaded per tile and its block map is built on every call, because its contents are
not known when the kernels are planned. A buffer's contents are known when the graph compiles (Dynamo hands the
backend the real tensors), and the most common hand-written causal mask is such a buffer. Where its last two dims
hold one value on a band of diagonals, ``lo <= col - row <= hi``, and another off it (the same in every leading
index), the score chain reads it as that band computed from the positions: the same code as a mask built
in-graph from ``tril`` or ``arange``, with its map cached per shape and its masked tiles skipped.

Its contents may change after the compile, so each call checks them (`ContentGuard`): a tensor seen before, at the
version seen last (its in-place writes count versions, as autograd's checks of saved tensors rely on), still holds
them, and another tensor, or a new version, is compared with the band on the device once. One that no longer
holds the band runs the attention's replaced ops from then on, with a warning and a hotspot (``strict`` raises).
A write that bypasses the version counter (through ``.data`` or a raw pointer) is not seen. While a CUDA graph
captures, nothing may read the device: a tensor not seen at its version then counts as changed, unless a whole-graph
replay checked the graph's argument before it records (`checked_by_caller`).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.fx

from fusepass.flash.blockmap import capturing

KNOWN = "fusepass_known_contents"  # a placeholder's meta: the `KnownInput` it stands for
# The dtypes whose two values the kernels hold exactly as literals (half floats held in fp32, int64 in int32).
BAND_DTYPES = (torch.bool, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KnownInput:
    """A graph input whose real tensor the compile holds (weakly), and the user's name for it."""

    tensor: weakref.ref
    name: str

    def at_call(self, x: object) -> KnownInput | None:
        """This input as a call passes it (`x`): its tensor, where a guard can track it; as the compile saw it,
        where `x` stands for its layout only."""
        if not is_real(x):
            return self
        return replace(self, tensor=weakref.ref(x)) if trackable(x) else None


def mark_known(graph: torch.fx.Graph, example_inputs: Sequence[object], names: Sequence[str]) -> None:
    """Mark the placeholders that stand for a module's buffer (or a parameter no gradient flows to) with the real
    tensor Dynamo passed for it (Dynamo marks those inputs static, user inputs not) and `names`, the user's
    names of the inputs."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, x, name in zip(placeholders, example_inputs, names):
        if trackable(x) and not x.requires_grad and getattr(x, "_dynamo_static_input_type", None) is not None:
            node.meta[KNOWN] = KnownInput(weakref.ref(x), name)


def trackable(x: object) -> bool:
    """A real tensor whose writes its version counter counts (an inference tensor counts none)."""
    return is_real(x) and not x.is_inference()


def known_input(node: torch.fx.Node) -> KnownInput | None:
    return node.meta.get(KNOWN) if node.op == "placeholder" else None


def known_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    """The real tensor a placeholder marked by `mark_known` stands for, while it lives."""
    known = known_input(node)
    return known.tensor() if known is not None else None


def is_real(x: object) -> bool:
    """A tensor with contents: not a fake or meta one (nor a stand-in for a tensor's layout)."""
    return isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor) and not x.is_meta


@dataclass(frozen=True)
class Band:
    """Contents whose last two dims hold `inside` where ``lo <= col - row <= hi`` (a missing bound: none on that
    side, one at least) and `outside` elsewhere, in every leading index alike."""

    lo: int | None
    hi: int | None
    inside: bool | int | float
    outside: bool | int | float
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def bounds(self) -> int:
        return (self.lo is not None) + (self.hi is not None)


def band_of(x: torch.Tensor) -> Band | None:
    """The band `x` holds, if it holds one (on its device: a few comparisons of its own size)."""
    if x.dim() < 2 or x.numel() == 0 or x.is_complex():
        return None
    rows, cols = x.shape[-2:]
    first = x.reshape(-1, rows, cols)[0]
    if not torch.equal(x, first.expand(x.shape)):
        return None
    # Constant along every diagonal: then the diagonals' values, from the first column's bottom up to the first row's
    # end, say it all.
    if not torch.equal(first[1:, 1:], first[:-1, :-1]):
        return None
    diagonals = torch.cat([first[1:, 0].flip(0), first[0]]).cpu()
    values = torch.unique(diagonals)
    # One value throughout masks nothing the positions could say: it is read as it is.
    if values.numel() != 2 or bool(torch.isnan(diagonals.float()).any()):
        return None
    on_diagonal = diagonals[rows - 1]  # the main diagonal's value first: tril's ones are its inside
    other = values[1] if bool(values[0] == on_diagonal) else values[0]
    for inside, outside in ((on_diagonal, other), (other, on_diagonal)):
        at = torch.nonzero(diagonals == inside).flatten()
        start, end = int(at[0]), int(at[-1])
        if end - start + 1 != at.numel():
            continue  # not one run of diagonals
        # The diagonal col - row of the run's ends; an end at the tensor's edge bounds nothing a read can reach.
        lo = start - (rows - 1) if start > 0 else None
        hi = end - (rows - 1) if end < diagonals.numel() - 1 else None
        return Band(lo, hi, inside.item(), outside.item(), x.dtype, tuple(x.shape))
    return None


class ContentsChanged(RuntimeError):
    """A tensor read as the band it held when compiled holds it no more."""


class _CheckedByCaller(threading.local):
    by_caller = False


_checked = _CheckedByCaller()


@contextmanager
def checked_by_caller() -> Iterator[None]:
    """Within it, a capture takes the guarded tensors as checked: the caller checked the graph's arguments (a
    whole-graph replay, before it records), and the op may see the recording's copies of them."""
    outer, _checked.by_caller = _checked.by_caller, True
    try:
        yield
    finally:
        _checked.by_caller = outer


class ContentGuard:
    """A band read from aux tensor `index` of an attention op, checked on each call (see the module's text). The
    layers of a stack share their plans (`dynamic.PlanTable`), each passing its own buffer: each tensor met is
    tracked at the version last checked."""

    def __init__(self, index: int, known: KnownInput, band: Band) -> None:
        self.index, self.name, self.band = index, known.name, band
        self._seen: list[tuple[weakref.ref, int]] = [(known.tensor, known.tensor()._version)]

    def check(self, aux: Sequence[torch.Tensor]) -> None:
        """Raise `ContentsChanged` where the tensor no longer holds the band. While the stream captures a CUDA graph
        the device cannot be read: a whole-graph recording checked the argument itself (`checked_by_caller`; the
        tensor the op sees may be the recording's copy of it), and in any other capture a tensor not seen at this
        version counts as changed (the replaced ops, which read it, are captured instead)."""
        tensor = aux[self.index]
        if self._seen_as_it_is(tensor):
            return
        if capturing(tensor.device):
            if not _checked.by_caller:
                raise ContentsChanged(f"{self.name} cannot be compared with what it held when compiled while a CUDA "
                                      "graph captures, and is not the tensor last checked at its version")
            return
        self.check_tensor(tensor)

    def _seen_as_it_is(self, tensor: torch.Tensor) -> bool:
        return any(seen() is tensor and tensor._version == version for seen, version in self._seen)

    def check_tensor(self, tensor: torch.Tensor) -> None:
        """`check` of the op's aux tensor `index` (`tensor`), where a caller holds it alone (a whole-graph replay
        checks the graph's argument before it replays)."""
        if self._seen_as_it_is(tensor):
            return
        held = f"what it held when compiled ({describe(self.band)}), which the attention's kernels compute"
        if not trackable(tensor):
            raise ContentsChanged(f"{self.name} is now an inference tensor, whose writes no version counts: "
                                  f"it may not hold {held}")
        if band_of(tensor) != self.band:
            raise ContentsChanged(f"{self.name} no longer holds {held}")
        self._seen = [(seen, version) for seen, version in self._seen if seen() is not None and seen() is not tensor]
        self._seen.append((weakref.ref(tensor), tensor._version))


def describe(band: Band) -> str:
    where = " and ".join([*([f"col - row >= {band.lo}"] if band.lo is not None else []),
                          *([f"col - row <= {band.hi}"] if band.hi is not None else [])])
    return f"{band.inside} where {where}, else {band.outside}"
