"""Launching Triton kernels without re-binding their arguments on every call.

``kernel[grid](*args)`` binds and specializes every argument and builds a cache key string before it reaches
the driver: 60–165 µs of host time per launch on the GPU machine (bench/results/launch-cost-*), more than some
of the kernels take. `launch` does that once per argument signature and then launches the compiled kernel
Triton returned for it (``CompiledKernel[grid](*values)``, every parameter's value in order); `BoundLaunch`
does the same for a launch plan that fixes the keywords, and looks at the positional arguments only.

The signature is finer than Triton's specialization, so a compiled kernel is never reused where Triton would
have compiled another. Per parameter: constexprs by value (functions by identity, held alive by the cache
entry so that the identity is not reused); tensors by dtype and 16-byte alignment of their data; ints by value,
or, for parameters Triton does not specialize (``do_not_specialize``: a dropout seed, a scalar read by value),
by the width classes Triton picks their type from; floats by type (Triton specializes none on value); tuples
and dataclasses (tensor descriptors) element by element.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from itertools import repeat
from typing import Any

import torch
from triton.runtime.jit import JITFunction

# Entries keep their kernels and constexpr functions alive (generated kernels come and go with models): the
# oldest go first. Kernels are keyed by identity (hashing a JITFunction hashes its source).
_CACHE_SIZE = 512

# How a parameter's value enters the signature.
_CONSTANT, _SPECIALIZED, _UNSPECIALIZED = 0, 1, 2


class _Parameters:
    """A kernel's parameters after the positional arguments of a call: names, defaults, and for every
    parameter how its value enters the signature."""

    __slots__ = ("kernel", "keyword_names", "defaults", "modes")

    def __init__(self, kernel: JITFunction, n_args: int) -> None:
        self.kernel = kernel  # held, so that its id is not reused while this entry lives
        params = kernel.params
        self.keyword_names = tuple(p.name for p in params[n_args:])
        self.defaults = tuple(p.default for p in params[n_args:])
        self.modes = tuple(_CONSTANT if p.is_constexpr else _UNSPECIALIZED if p.do_not_specialize
                           else _SPECIALIZED for p in params)

    def values(self, args: tuple, keywords: dict[str, Any]) -> list:
        """Every parameter's value in order, constexprs included (the launcher skips those)."""
        return [*args, *(keywords.get(name, default) for name, default in zip(self.keyword_names, self.defaults))]


_parameters: OrderedDict[tuple[int, int], _Parameters] = OrderedDict()
_compiled: OrderedDict[tuple, Any] = OrderedDict()  # signature -> (compiled kernel, what it holds alive)


def _signature(values: Any, modes: Any, held: list) -> tuple:
    """The signature of `values`, each entering by its mode. One loop with the common types inline: this runs
    on every launch, over ~90 values for a flash kernel."""
    signature = []
    append = signature.append
    for value, mode in zip(values, modes):
        # Exact types first: isinstance against torch.Tensor runs a Python-level metaclass check.
        kind = type(value)
        if kind is int:
            append((value < -2**31, value < 0, value < 2**31, value < 2**63) if mode == _UNSPECIALIZED else value)
        elif kind is torch.Tensor:
            append((value.dtype, value.data_ptr() % 16 == 0))
        elif kind is tuple or kind is list:
            append((kind, _signature(value, repeat(mode), held)))
        elif kind is float:
            append((kind, value) if mode == _CONSTANT else kind)
        elif kind is bool or kind is str or value is None:
            append((kind, value))
        elif isinstance(value, torch.Tensor):
            append((value.dtype, value.data_ptr() % 16 == 0))
        elif dataclasses.is_dataclass(value):
            append((kind, _signature(vars(value).values(), repeat(mode), held)))
        else:
            held.append(value)
            append((kind, id(value)))
    return tuple(signature)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **keywords: Any) -> None:
    """``kernel[grid](*args, **keywords)`` (``num_warps`` and ``num_stages`` among the keywords); after the
    first call with an argument signature, straight through that compiled kernel's launcher. Kernels other
    than plain ``triton.jit`` functions (the interpreter's) always take the first way."""
    if type(kernel) is not JITFunction:
        kernel[grid](*args, **keywords)
        return
    parameters = _parameters.get((id(kernel), len(args)))
    if parameters is None:
        parameters = _parameters[id(kernel), len(args)] = _Parameters(kernel, len(args))
        if len(_parameters) > _CACHE_SIZE:
            _parameters.popitem(last=False)
    values = parameters.values(args, keywords)
    held: list = [kernel]
    options = tuple([(name, value) for name, value in keywords.items() if name not in parameters.keyword_names])
    key = (id(kernel), torch.cuda.current_device(), options, _signature(values, parameters.modes, held))
    entry = _compiled.get(key)
    if entry is not None:
        entry[0][(*grid, 1, 1)[:3]](*values)
        return
    compiled = kernel[grid](*args, **keywords)
    if compiled is not None:  # None: not compiled on this thread yet (Triton's asynchronous compile mode)
        _compiled[key] = compiled, held
        if len(_compiled) > _CACHE_SIZE:
            _compiled.popitem(last=False)


class BoundLaunch:
    """`kernel` with its keywords (constexprs, launch options) and the number of its positional arguments
    fixed, as a launch plan fixes them: a call looks up the signature of its positional arguments alone."""

    def __init__(self, kernel: Any, n_args: int, **keywords: Any) -> None:
        self.kernel = kernel
        self.keywords = keywords  # held: constexpr functions keep their identity
        self.direct = type(kernel) is JITFunction
        if self.direct:
            parameters = _Parameters(kernel, n_args)
            self.modes = parameters.modes[:n_args]
            self.keyword_values = parameters.values((), keywords)
        self._compiled: dict[tuple, Any] = {}  # signature -> (compiled kernel, what it holds alive)

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        if not self.direct:
            self.kernel[grid](*args, **self.keywords)
            return
        held: list = []
        key = (torch.cuda.current_device(), _signature(args, self.modes, held))
        entry = self._compiled.get(key)
        if entry is not None:
            entry[0][(*grid, 1, 1)[:3]](*args, *self.keyword_values)
            return
        compiled = self.kernel[grid](*args, **self.keywords)
        if compiled is not None:
            self._compiled[key] = compiled, held
