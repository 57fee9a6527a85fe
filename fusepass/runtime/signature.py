"""The signature of a kernel launch's arguments: what decides which compiled kernel the launch takes.

Finer than Triton's specialization, so that a compiled kernel is never reused where Triton would have compiled
another. Per value, by its mode: constexprs by value (functions and other objects by identity, held alive by
whoever keeps the signature, so that the identity is not reused); tensors by dtype and 16-byte alignment of
their data; ints by value, or, for parameters Triton does not specialize (``do_not_specialize``: a dropout
seed, a scalar read by value), by the width classes Triton picks their type from; floats by type (Triton
specializes none on value); tuples and dataclasses (tensor descriptors) element by element.

`signature` walks the values on every call, and a flash kernel's launch passes many: that walk was a large part
of the attention op's Python. A `SignatureOf` generates, per structure of the values it meets (the types, the
tuples' lengths, the dataclasses' fields), a function that checks that structure and returns the structure's
varying leaves in one expression: the structure's signature is fixed by the check, so the leaves alone say the
rest.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch

# How a value enters the signature.
CONSTANT, SPECIALIZED, UNSPECIALIZED = 0, 1, 2


def signature(values: Any, modes: Any, held: list) -> tuple:
    """The signature of `values`, each entering by its mode; objects keyed by identity are appended to
    `held`."""
    found = []
    append = found.append
    for value, mode in zip(values, modes):
        # Exact types first: isinstance against torch.Tensor runs a Python-level metaclass check.
        kind = type(value)
        if kind is int:
            append((value < -2**31, value < 0, value < 2**31, value < 2**63) if mode == UNSPECIALIZED else value)
        elif kind is torch.Tensor:
            append((value.dtype, value.data_ptr() % 16 == 0))
        elif kind is tuple or kind is list:
            append((kind, signature(value, repeat(mode), held)))
        elif kind is float:
            append((kind, value) if mode == CONSTANT else kind)
        elif kind is bool or kind is str or value is None:
            append((kind, value))
        elif isinstance(value, torch.Tensor):
            append((value.dtype, value.data_ptr() % 16 == 0))
        elif dataclasses.is_dataclass(value):
            append((kind, signature(vars(value).values(), repeat(mode), held)))
        else:
            held.append(value)
            append((kind, id(value)))
    return tuple(found)


class _Structure:
    """The source of one structure's function: the checks that a value has it, and its leaves' expressions."""

    def __init__(self) -> None:
        self.checks: list[str] = []
        self.leaves: list[str] = []
        self.names: dict[str, Any] = {}  # the types the checks name

    def type_name(self, kind: type) -> str:
        name = f"T{len(self.names)}"
        self.names[name] = kind
        return name

    def add(self, expression: str, value: Any, mode: int) -> None:
        kind = type(value)
        if value is None:
            self.checks.append(f"{expression} is None")
            return
        self.checks.append(f"type({expression}) is {self.type_name(kind)}")
        if kind is int:
            self.leaves.append(f"({expression} < -2**31, {expression} < 0, {expression} < 2**31, "
                               f"{expression} < 2**63)" if mode == UNSPECIALIZED else expression)
        elif isinstance(value, torch.Tensor):
            self.leaves += [f"{expression}.dtype", f"{expression}.data_ptr() % 16 == 0"]
        elif kind is tuple or kind is list:
            self.checks.append(f"len({expression}) == {len(value)}")
            for i, element in enumerate(value):
                self.add(f"{expression}[{i}]", element, mode)
        elif kind is float:
            if mode == CONSTANT:
                self.leaves.append(expression)
        elif kind is bool or kind is str:
            self.leaves.append(expression)
        elif dataclasses.is_dataclass(value):  # its type checked, its attributes are its fields
            for name, field in vars(value).items():
                self.add(f"{expression}.{name}", field, mode)
        else:
            self.leaves.append(f"id({expression})")

    def function(self, arity: int) -> Callable[..., tuple | None]:
        parameters = ", ".join(f"a{i}" for i in range(arity))
        source = (f"def structure_key({parameters}):\n"
                  f"    if not ({' and '.join(self.checks) or 'True'}):\n"
                  f"        return None\n"
                  f"    return ({''.join(leaf + ', ' for leaf in self.leaves)})\n")
        namespace = dict(self.names)
        exec(compile(source, "<fusepass signature>", "exec"), namespace)
        return namespace["structure_key"]


class SignatureOf:
    """`signature` of the values of a fixed number of parameters with fixed modes, fast: the key of a call is
    (its structure's number, the leaves) where one of the structures met so far fits the values, else
    (None, `signature`). Equal keys mean equal signatures. A key never names the objects it keys by identity:
    `held` gives them, for whoever keeps a key."""

    # Structures a launch site takes stay few (a kernel's arguments keep their types from call to call);
    # past this many, values of yet another structure take `signature`.
    MAX_STRUCTURES = 8

    def __init__(self, modes: Sequence[int]) -> None:
        self.modes = tuple(modes)
        self.structures: list[Callable[..., tuple | None]] = []

    def key(self, values: Sequence[Any]) -> tuple:
        for number, structure_key in enumerate(self.structures):
            leaves = structure_key(*values)
            if leaves is not None:
                return number, leaves
        if len(self.structures) < self.MAX_STRUCTURES and len(values) == len(self.modes):
            structure = _Structure()
            for i, (value, mode) in enumerate(zip(values, self.modes)):
                structure.add(f"a{i}", value, mode)
            self.structures.append(structure.function(len(values)))
            return len(self.structures) - 1, self.structures[-1](*values)
        return None, signature(values, self.modes, [])

    def held(self, values: Sequence[Any]) -> list:
        """The objects the key of `values` names by identity."""
        held: list = []
        signature(values, self.modes, held)
        return held
