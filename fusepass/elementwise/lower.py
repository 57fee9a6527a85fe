"""A fused group → the program its kernel runs and how the launcher feeds it.

Every member is evaluated at the coordinates its consumers read it at (an affine map of the group's
root coordinates, ``coords``); a member read at two different maps (``x + x.t()``) is computed twice,
which costs arithmetic, never memory traffic. External inputs become loads, one per map they are read at. A piece
of a cat or slice_backward (``pieces``) is evaluated under the guard that says where it is: loads under guards
are masked by them.
A group holding row reductions has their input's shape as its root: each reduction is read in the row it
reduces (its input at the identity map), and a value of a row's shape is written once per row.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fusepass.elementwise.coords import Map, broadcast, identity, is_mapped_view, through_view
from fusepass.elementwise.partition import Group, is_constant, root_shape
from fusepass.elementwise.pieces import is_piecewise, pieces
from fusepass.elementwise.reduction import (NLL_BACKWARD, column_sum_of, expand, is_composite, is_row_reduction,
                                           keeps_dim, read_inputs)
from fusepass.elementwise.program import Guard, Load, Program, Ref, Step
from fusepass.fx_util import val


class NotLowerable(Exception):
    """The group cannot run as one kernel; the message says why."""


@dataclass(frozen=True)
class Access:
    """How the launcher feeds one load: which group input, read at which coordinates."""

    input: int
    map: Map
    by_value: bool


@dataclass(frozen=True)
class OutputLayout:
    dtype: torch.dtype
    stride_order: tuple[int, ...]  # dims from outermost to innermost in memory, as eager lays them out
    # "root": the group's root shape; in a group with row reductions, "row" (the root with its last size 1) or
    # "row_dropped" (the root without its last dimension); a column sum's, "column" (the root's last size) or
    # "column_kept" (its other sizes 1)
    space: str = "root"


@dataclass
class Lowered:
    program: Program
    accesses: tuple[Access, ...]
    rank: int
    # Each root dimension: its static size, or (access index, input dim) to read it from at run time.
    root_shape: tuple[Any, ...]
    outputs: tuple[OutputLayout, ...]


def stride_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """Dimensions from largest to smallest stride; ties keep logical order, so contiguous is (0, 1, ...)."""
    strides = [int(s) if isinstance(s, int) else s.node.hint for s in tensor.stride()]
    return tuple(sorted(range(tensor.dim()), key=lambda d: -strides[d]))


# Where a member is evaluated: a map of the root coordinates, and the guards it is needed under.
At = tuple[Map, frozenset[Guard]]


def _placed(node: torch.fx.Node, m: Map) -> list[tuple[torch.fx.Node | None, Map, Guard | None]]:
    """The pieces of a piecewise node read at `m`: each input (None: zeros) read at `m` shifted back by the piece's
    start, under the guard of where it is (None where the dim is read at one coordinate, the piece holding it)."""
    dim, found = pieces(node)
    row = m[dim]
    moving = [j for j, coefficient in enumerate(row[:-1]) if coefficient]
    if not moving:
        found = [p for p in found if p.start <= row[-1] < p.stop]
    elif len(moving) > 1 or row[moving[0]] != 1:
        raise NotLowerable(f"{node.target} read at coordinates that move its dim otherwise than one of the group's")
    placed = []
    for piece in found:
        shifted = m[:dim] + (row[:-1] + (row[-1] - piece.start,),) + m[dim + 1:]
        guard = Guard(moving[0], piece.start - row[-1], piece.stop - row[-1]) if moving else None
        placed.append((piece.input, shifted, guard))
    return placed


def _arg_maps(node: torch.fx.Node, m: Map, rank: int, members: set[torch.fx.Node]
              ) -> list[tuple[torch.fx.Node, Map]]:
    if is_mapped_view(node):
        return [(node.args[0], through_view(node, m, rank))]
    if column_sum_of(node, members) is not None:  # its input (a sum's, at the root's coordinates) summed by the kernel
        return [(node.args[0], identity(rank))]
    if is_row_reduction(node):
        # Read in the row it reduces: its outer coordinates are the root's own (a softmax's, all of them).
        if m[:rank - 1] != identity(rank)[:rank - 1] or (is_composite(node) and m != identity(rank)):
            raise NotLowerable("a row reduction is read at another row than it reduces")
        if node.target == NLL_BACKWARD:  # the targets (and a per-row gradient) by row, scalars everywhere
            return [(a, identity(rank)[:val(a).dim()] if val(a).dim() else ()) for a in read_inputs(node)]
        return [(a, identity(rank)) for a in node.all_input_nodes]
    shape = tuple(val(node).shape)
    return [(a, broadcast(m, shape, tuple(val(a).shape), rank)) for a in node.all_input_nodes]


def lower(group: Group, device: torch.device) -> Lowered:
    members = set(group.nodes)
    inputs = group.inputs
    reduced = root_shape(group.nodes)
    root = reduced if reduced is not None else tuple(val(group.outputs[0]).shape)
    rank = len(root)
    spaces = [_space(out, root, members) for out in group.outputs]

    # Where each member is needed (`At`), collected from the outputs backwards.
    needed: dict[torch.fx.Node, list[At]] = defaultdict(list)
    for out, space in zip(group.outputs, spaces):
        needed[out].append((output_map(space, rank), frozenset()))
    for node in reversed(group.nodes):
        for m, guards in needed.get(node, []):
            if is_piecewise(node):
                arg_ats = [(arg, (arg_map, guards | ({guard} if guard else set())))
                           for arg, arg_map, guard in _placed(node, m) if arg is not None]
            else:
                arg_ats = [(arg, (arg_map, guards)) for arg, arg_map in _arg_maps(node, m, rank, members)]
            for arg, at in arg_ats:
                if arg in members and at not in needed[arg]:
                    needed[arg].append(at)

    loads: list[Load] = []
    accesses: list[Access] = []
    steps: list[Step] = []
    guard_list: list[Guard] = []
    refs: dict[tuple[torch.fx.Node, At], Ref] = {}

    def add_step(target: Any, args: tuple[Any, ...], result: torch.dtype, **kwargs: Any) -> Ref:
        steps.append(Step(target, args, tuple(sorted(kwargs.items())), result, False))
        return Ref("step", len(steps) - 1)

    def guard_ref(guard: Guard) -> Ref:
        if guard not in guard_list:
            guard_list.append(guard)
        return Ref("guard", guard_list.index(guard))

    def ref_of(arg: torch.fx.Node, at: At) -> Ref:
        if (arg, at) in refs:
            return refs[(arg, at)]
        if arg in members:
            raise AssertionError("members are emitted before their consumers")
        if is_constant(arg):
            ref = _emit_constant(arg, steps)
        else:
            value = val(arg)
            by_value = value.device != device
            loads.append(Load(value.dtype, value.dim() == 0, by_value,
                              tuple(sorted(guard_ref(g).index for g in at[1]))))
            accesses.append(Access(inputs.index(arg), at[0], by_value))
            ref = Ref("load", len(loads) - 1)
        refs[(arg, at)] = ref
        return ref

    for node in group.nodes:
        for m, guards in needed.get(node, []):
            at = (m, guards)
            if is_mapped_view(node):
                refs[(node, at)] = ref_of(node.args[0], (through_view(node, m, rank), guards))
                continue
            value = val(node)
            if is_piecewise(node):
                refs[(node, at)] = _piecewise(node, m, guards, ref_of, guard_ref, add_step)
                continue
            arg_maps = dict(_arg_maps(node, m, rank, members))

            def operand(a: Any) -> Any:
                if isinstance(a, torch.fx.Node):
                    return ref_of(a, (arg_maps[a], guards))
                if isinstance(a, (list, tuple)):
                    return tuple(operand(x) for x in a)
                return a

            if column_sum_of(node, members) is not None:  # not a step: the kernel adds up the sum's input
                refs[(node, at)] = operand(node.args[0])
                continue
            if is_composite(node):
                refs[(node, at)] = expand(node, [operand(a) for a in read_inputs(node)], add_step)
                continue
            steps.append(Step(node.target, tuple(operand(a) for a in node.args),
                              tuple(sorted((k, operand(v)) for k, v in node.kwargs.items())),
                              value.dtype, value.dim() == 0))
            refs[(node, at)] = Ref("step", len(steps) - 1)

    outputs = tuple((refs[(out, (output_map(space, rank), frozenset()))], val(out).dtype)
                    for out, space in zip(group.outputs, spaces))
    program = Program(tuple(loads), tuple(steps), outputs, tuple(guard_list))
    return Lowered(
        program=program,
        accesses=tuple(accesses),
        rank=rank,
        root_shape=_root_shape(root, inputs, accesses),
        outputs=tuple(OutputLayout(val(o).dtype, stride_order(val(o)), space)
                      for o, space in zip(group.outputs, spaces)),
    )


def _piecewise(node: torch.fx.Node, m: Map, guards: frozenset[Guard], ref_of: Any, guard_ref: Any, add_step: Any
               ) -> Ref:
    """A cat or slice_backward at `m`: the piece whose guard holds (zeros outside a slice_backward's), each piece read
    under its guard."""
    dtype = val(node).dtype
    found = []
    for arg, arg_map, guard in _placed(node, m):
        if arg is None:
            value = add_step(torch.ops.aten.scalar_tensor.default, (0,), dtype, dtype=dtype)
        else:
            value = ref_of(arg, (arg_map, guards | ({guard} if guard else set())))
            if val(arg).dtype != dtype:  # cat promotes its inputs' dtypes: each piece converted, as a cast does
                value = add_step(torch.ops.aten._to_copy.default, (value,), dtype, dtype=dtype)
        found.append((value, guard))
    value = found[-1][0]
    for piece, guard in reversed(found[:-1]):  # the last piece where no earlier one's guard holds
        value = add_step(torch.ops.aten.where.self, (guard_ref(guard), piece, value), dtype)
    return value


def _space(out: torch.fx.Node, root: tuple[Any, ...], members: set[torch.fx.Node]) -> str:
    summed = column_sum_of(out, members)
    if summed is not None:
        return "column_kept" if keeps_dim(summed) else "column"
    shape = tuple(val(out).shape)
    if tuple(map(str, shape)) == tuple(map(str, root)):
        return "root"
    return "row" if len(shape) == len(root) else "row_dropped"


def output_map(space: str, rank: int) -> Map:
    """Where an output is read in root coordinates: a row's value at its row, whatever the column."""
    m = identity(rank)
    if space in ("column", "column_kept"):  # the summed value, at each element
        return m
    if space == "row":
        return m[:-1] + ((0,) * (rank + 1),)
    return m[:-1] if space == "row_dropped" else m


def _emit_constant(node: torch.fx.Node, steps: list[Step]) -> Ref:
    value = val(node)
    args = tuple(None if isinstance(a, torch.fx.Node) else a for a in node.args)
    steps.append(Step(node.target, args, (), value.dtype, value.dim() == 0))
    return Ref("step", len(steps) - 1)


def _root_shape(root: tuple[Any, ...], inputs: list[torch.fx.Node], accesses: list[Access]
                ) -> tuple[Any, ...]:
    """Static sizes stay; a symbolic size is read at run time off an input that spans that dimension."""
    shape: list[Any] = []
    for j, size in enumerate(root):
        if isinstance(size, int):
            shape.append(size)
            continue
        source = None
        for k, access in enumerate(accesses):
            if access.by_value:
                continue
            in_shape = val(inputs[access.input]).shape
            for i, row in enumerate(access.map):
                unit = all(v == (1 if c == j else 0) for c, v in enumerate(row))
                if unit and str(in_shape[i]) == str(size):
                    source = (k, i)
                    break
            if source:
                break
        if source is None:
            raise NotLowerable(f"size {size} of the output is not the size of any input")
        shape.append(source)
    return tuple(shape)
