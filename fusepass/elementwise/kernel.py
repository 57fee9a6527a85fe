"""The elementwise kernel: generated Triton source for one fused program, and its launcher.

The kernel walks the group's output coordinates in tiles: the innermost dimension across a tile's
columns (``YBLOCK``, contiguous in memory for the usual layouts) and the outer dimensions, flattened,
across its rows (``XBLOCK``). Each load and store is ``base + Σ c_d · stride_d`` with sizes and strides
as arguments, so one compiled kernel serves every shape of the same rank. Before launching, the launcher
drops size-1 dimensions and merges dimensions that are contiguous for every operand, as PyTorch's
TensorIterator does: a contiguous chain becomes one flat dimension with no index arithmetic.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fusepass.codegen.modules import load_module
from fusepass.codegen.operands import TRITON_DTYPE, Operand, held_dtype, to_stored
from fusepass.codegen.pointwise import REGISTER_HUNGRY
from fusepass.codegen.translate import translate
from fusepass.elementwise.coords import strides_at
from fusepass.elementwise.lower import Lowered
from fusepass.elementwise.program import Program, Ref
from fusepass.runtime.device import interpreting
from fusepass.runtime.launch import BoundLaunch
from fusepass.runtime.replay import pointwise_replays
from fusepass.runtime.sizes import cdiv, next_power_of_2

INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------------
# Configs


# A program computes every lane of its tile, the masked ones too: rows of 11585 in tiles 2048 wide compute 6 %
# more than they keep. Row tiles narrow, down to MIN_ROW_TILE, until the rows' padding is at most this fraction.
MAX_ROW_PADDING = 1 / 32
MIN_ROW_TILE = 128

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


# A program of 2048 elements takes 8 warps: 8 elements a thread. A translation that holds many values per element
# (REGISTER_HUNGRY) takes so many registers at 8 elements a thread that few warps share an SM: its latencies go
# unhidden (digamma's kernel ran slower than Inductor's). At 2 elements a thread it takes a fraction of them, and
# several times as many warps share an SM.
HUNGRY_TILE = 512


def choose_blocks(sizes: Sequence[int], register_hungry: bool = False) -> tuple[int, int, int]:
    """(XBLOCK, YBLOCK, num_warps) for coalesced ``sizes``: about ``tile`` elements per program."""
    gpu_tile = HUNGRY_TILE if register_hungry else 2048  # at 8 warps: 2 or 8 elements a thread
    tile = 1 << 14 if interpreting() else gpu_tile
    inner = sizes[-1]
    outer = 1
    for s in sizes[:-1]:
        outer *= s
    yblock = min(next_power_of_2(inner), tile)
    if len(sizes) > 1:
        while yblock > MIN_ROW_TILE and cdiv(inner, yblock) * yblock > inner * (1 + MAX_ROW_PADDING):
            yblock //= 2
    xblock = 1 if len(sizes) == 1 else min(next_power_of_2(outer), max(1, tile // yblock))
    num_warps = 8 if xblock * yblock >= gpu_tile else 4
    return xblock, yblock, num_warps


@dataclass(frozen=True)
class Variant:
    """What the source depends on beyond the program: the coalesced rank and which strides are zero."""

    rank: int
    load_dims: tuple[tuple[bool, ...], ...]  # per load: which coalesced dims it moves along
    load_base: tuple[bool, ...]  # per load: a nonzero base offset (a slice or select inside the group)
    output_dims: tuple[tuple[bool, ...], ...]
    wide: bool  # offsets may pass 2**31: index in int64
    # Rank > 1: column blocks on the grid's first axis (the GPU starts programs along it first: neighbours in
    # memory run together), row blocks on its second (at most MAX_GRID_Y); else one axis, split by a division
    # per program (integer instructions per thread that a compute-bound chain such as gelu(x*0.5+b)*sigmoid(x)
    # pays for). Row blocks first moved x*row+col slower than one axis did.
    grid_2d: bool
    even: bool  # the blocks divide the sizes: no masks
    guard_dims: tuple[int, ...] = ()  # per guard of the program, the coalesced dim it is on (never merged)


# ---------------------------------------------------------------------------------------------------
# Kernel source


def offset(prefix: str, dims: tuple[bool, ...], base: bool) -> str:
    """An operand's offset: its strides along the coordinates it moves along, and its base offset."""
    terms = [f"c{d} * {prefix}_s{d}" for d, moves in enumerate(dims) if moves]
    if base:
        terms.append(f"{prefix}_base")
    return " + ".join(terms) if terms else "0"


def _load_mask(dims: tuple[bool, ...], even: bool, guards: tuple[int, ...] = ()) -> str:
    """The mask of a load moving along `dims`: only the bounds of the tile axes it moves along (none where the blocks
    divide the sizes), and the guards it is read under (0 where one fails: a piece read past its place). A load
    broadcast along the tile's rows (or columns) is then a row (column) of the tile, broadcast in registers, not a
    tile of repeated addresses: fewer load instructions, and vectorized along the columns. A load moving along no
    dim reads one element, in bounds wherever its piece is placed: no guard (a scalar's mask is a scalar)."""
    along_columns, along_rows = dims[-1], any(dims[:-1])
    guards = guards if any(dims) else ()
    terms = [f"g{i}" for i in guards]
    if not even and (along_columns or along_rows):
        if along_columns and along_rows or len(dims) == 1:
            terms.insert(0, "mask")
        else:
            terms.insert(0, "col_mask" if along_columns else "row_mask")
    if not terms:
        return ""
    return f", mask={' & '.join(terms)}" + (", other=0" if guards else "")


def kernel_params(program: Program, rank: int, load_dims: tuple[tuple[bool, ...], ...], load_base: tuple[bool, ...],
                  output_dims: tuple[tuple[bool, ...], ...]) -> list[str]:
    """The parameters of a generated kernel before its block sizes, in the order its launcher passes them: the
    loads (pointers or values), the outputs, the sizes, then each operand's strides along the dims it moves along
    (and a load's base offset)."""
    params = [f"l{k}_value" if load.by_value else f"l{k}_ptr" for k, load in enumerate(program.loads)]
    params += [f"o{i}_ptr" for i in range(len(program.outputs))]
    params += [f"n{d}" for d in range(rank)]
    for k, dims in enumerate(load_dims):
        params += [f"l{k}_s{d}" for d, moves in enumerate(dims) if moves]
        if load_base[k]:
            params.append(f"l{k}_base")
    for i, dims in enumerate(output_dims):
        params += [f"o{i}_s{d}" for d, moves in enumerate(dims) if moves]
    return params


def kernel_source(name: str, program: Program, variant: Variant) -> str:
    q = variant.rank
    params = kernel_params(program, q, variant.load_dims, variant.load_base, variant.output_dims)
    params += ["XBLOCK: tl.constexpr", "YBLOCK: tl.constexpr"]

    wide = ".to(tl.int64)" if variant.wide else ""
    if q == 1:
        body = [f"c0 = tl.program_id(0){wide} * YBLOCK + tl.arange(0, YBLOCK)"]
        if not variant.even:
            body.append("mask = c0 < n0")
    else:
        last = q - 1
        outer = " * ".join(f"n{d}" for d in range(last))
        if variant.grid_2d:
            body = [f"y_pid = tl.program_id(0){wide}", f"x_pid = tl.program_id(1){wide}"]
        else:
            body = [f"pid = tl.program_id(0){wide}", f"y_blocks = tl.cdiv(n{last}, YBLOCK)", "y_pid = pid % y_blocks",
                    "x_pid = pid // y_blocks"]
        body += [f"c{last} = y_pid * YBLOCK + tl.arange(0, YBLOCK)[None, :]",
                 "x = x_pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]"]
        if not variant.even:
            body += [f"row_mask = x < {outer}", f"col_mask = c{last} < n{last}", "mask = row_mask & col_mask"]
        rest = "x"
        for d in range(last - 1, 0, -1):
            body += [f"c{d} = {rest} % n{d}", f"x{d} = {rest} // n{d}"]
            rest = f"x{d}"
        body.append(f"c0 = {rest}")

    # Triton's interpreter types a comparison of two scalars as the scalars' dtype, and broadcasting the result
    # to a tile converts it to that dtype (a bool tile of floats, which `&` rejects). Interpreted, a scalar takes
    # the tile's shape where it is read; compiled, it is broadcast where it meets a tile, as Triton does.
    tile = ("[YBLOCK]" if q == 1 else "[XBLOCK, YBLOCK]") if interpreting() else None
    operands: dict[Ref, Operand] = {}
    for i, (guard, d) in enumerate(zip(program.guards, variant.guard_dims)):
        body.append(f"g{i} = (c{d} >= {guard.lo}) & (c{d} < {guard.hi})")
        operands[Ref("guard", i)] = Operand(f"g{i}", torch.bool, False)
    for k, load in enumerate(program.loads):
        if load.by_value:
            value = f"l{k}_value"
        else:
            where = offset(f"l{k}", variant.load_dims[k], variant.load_base[k])
            mask = _load_mask(variant.load_dims[k], variant.even, load.guards)
            value = f"tl.load(l{k}_ptr + {where}{mask})"
            if held_dtype(load.dtype) != load.dtype:
                value += f".to({TRITON_DTYPE[held_dtype(load.dtype)]})"
        if tile and (load.by_value or not any(variant.load_dims[k])):
            value = f"tl.broadcast_to({value}, {tile})"
        body.append(f"l{k} = {value}")
        operands[Ref("load", k)] = Operand(f"l{k}", load.dtype, load.zero_dim, rounded=True)

    def resolve(a: Any) -> Any:
        if isinstance(a, Ref):
            return operands[a]
        if isinstance(a, tuple):
            return tuple(resolve(x) for x in a)
        return a

    for j, step in enumerate(program.steps):
        result = translate(step.target, resolve(step.args), {k: resolve(v) for k, v in step.kwargs},
                           step.dtype)
        body.append(f"t{j} = {result.expr}")
        operands[Ref("step", j)] = Operand(f"t{j}", step.dtype, step.zero_dim, result.rounded)

    for i, (ref, dtype) in enumerate(program.outputs):
        value = operands[ref].expr
        if held_dtype(dtype) != dtype:
            value = to_stored(value, held_dtype(dtype), dtype)
        where = offset(f"o{i}", variant.output_dims[i], False)
        body.append(f"tl.store(o{i}_ptr + {where}, {value}{'' if variant.even else ', mask=mask'})")

    return jit_text(name, params, body)


def jit_text(name: str, params: list[str], body: list[str], unspecialized: Sequence[str] = ()) -> str:
    """A generated kernel's source: its parameters and body under ``triton.jit``; Triton specialises none of the
    `unspecialized` ones on their values."""
    # Scalars read by value change from call to call: one compiled kernel for all of their values.
    by_value = [p for p in params if p.endswith("_value") or p in unspecialized]
    decorator = f"@triton.jit(do_not_specialize={by_value})" if by_value else "@triton.jit"
    lines = [decorator, f"def {name}({', '.join(params)}):"] + [f"    {line}" for line in body]
    return "\n".join(lines) + "\n"


# Weakly: a kernel lives as long as the launch plans that launch it.
_kernels: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()


def compiled_kernel(name: str, program: Program, variant: Any, source: Callable[[], str]) -> Any:
    """One jitted kernel per (program, variant): identical groups share it. `source` writes it where none is."""
    key = (program, variant)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = getattr(load_module(source()), name)
    return kernel


# ---------------------------------------------------------------------------------------------------
# Launcher


class Scratch(Protocol):
    """Outputs a kernel writes for the group's to be made from, after it: allocated inside the launched sequence
    (a replay's memory pool holds them), so that the group's outputs alone leave it."""

    def written(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """What the kernel writes, given the group's outputs: new tensors in place of some."""

    def finish(self, written: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        """The group's outputs from what the kernel wrote."""


@dataclass
class LaunchPlan:
    """Everything about a launch that depends only on input shapes and strides."""

    launch: BoundLaunch | None  # the kernel with its block sizes, warps, and the sizes and strides it indexes with
    # (None where the outputs are empty)
    out_shapes: tuple[tuple[int, ...], ...]
    out_strides: tuple[tuple[int, ...], ...]
    grid: tuple[int]
    # What the kernel writes in place of some of the group's outputs, and how they become them (row_kernel: each
    # program's column sums, added up), as launches of their own: both run inside the replayed sequence
    scratch: Scratch | None = None
    serial: int = field(default_factory=itertools.count().__next__)  # names it in replay keys (ids recur)


def contiguous_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def _coalesce(root: Sequence[int], order: Sequence[int], operands: list[tuple[int, ...]],
              separate: Sequence[int] = ()) -> tuple[list[int], list[list[int]], dict[int, int]]:
    """Drop size-1 dims, then merge neighbours (in memory order) that are contiguous for every operand; the dims in
    `separate` (guarded: the kernel reads their coordinate) are kept, each a dim of its own. Also, for each of
    those, its coalesced dim."""
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in operands]
    position: dict[int, int] = {}
    previous = None
    for d in order:
        if root[d] == 1 and d not in separate:
            continue
        if sizes and d not in separate and previous not in separate and \
                all(st[-1] == op[d] * root[d] for st, op in zip(strides, operands)):
            sizes[-1] *= root[d]
            for st, op in zip(strides, operands):
                st[-1] = op[d]
            continue
        position[d] = len(sizes)
        previous = d
        sizes.append(root[d])
        for st, op in zip(strides, operands):
            st.append(op[d])
    if not sizes:  # a single element: one dimension of size 1 keeps every offset a block
        return [1], [[1] for _ in operands], position
    return sizes, strides, position


@dataclass(frozen=True)
class PaddedOutput:
    """A group's output the kernel writes into the first rows and columns of a zero-padded buffer: a padded
    matmul's operand (fusepass/matmul/pads_in_producers.py), written where it is read instead of copied there. The
    group's call returns the buffer after its own outputs."""

    output: int  # which of the group's outputs
    output_shape: tuple[int, ...]  # its shape (the group's root), and strides within the buffer
    strides: tuple[int, ...]
    read_as: tuple[int, ...]  # the output viewed as the matmul reads it, [..., R, L]
    rows: int  # what the buffer adds past R and L
    columns: int

    @property
    def shape(self) -> tuple[int, ...]:
        *batch, r, length = self.read_as
        return (*batch, r + self.rows, length + self.columns)

    def zero_pads(self, buffer: torch.Tensor) -> None:
        r, length = self.read_as[-2:]
        if self.columns:
            buffer[..., :r, length:].zero_()
        if self.rows:
            buffer[..., r:, :].zero_()

    def of(self, output: torch.Tensor) -> torch.Tensor:
        """The buffer from the output as the group's own ops make it (the unfused path): a padded copy."""
        return torch.nn.functional.pad(output.reshape(self.read_as), (0, self.columns, 0, self.rows))


class PointwiseLauncher:
    """Runs one fused group: allocates its outputs as eager lays them out and launches its kernel.

    It stands in the FX graph as a call_function target, so its name shows in the rewritten graph.
    """

    def __init__(self, name: str, lowered: Lowered, device: torch.device,
                 fallback: Callable[..., tuple[torch.Tensor, ...]],
                 on_failure: Callable[[Exception], None],
                 on_first_run: Callable[[Callable[[], Any], Callable[[], Any]], None] | None = None,
                 replay: bool = True) -> None:
        self.__name__ = self.__qualname__ = name
        self.__module__ = "fusepass.elementwise.kernel"
        self.lowered = lowered
        self.device = device
        self.fallback = fallback
        self.on_failure = on_failure
        # Given the kernel and the unfused ops on the first call's inputs (FUSEPASS_PROFILE times them).
        self.on_first_run = on_first_run
        self.replay = replay  # launches replayed as CUDA graphs where a call's tensors repeat (kernels/replay.py)
        self._plans: dict[tuple[Any, ...], LaunchPlan] = {}
        self.failed = False  # a launch failed: the group's own ops run from then on
        self.padded: tuple[PaddedOutput, ...] = ()

    def write_padded(self, padded: PaddedOutput) -> int:
        """Write an output into a zero-padded buffer as well (`PaddedOutput`); the index of the buffer among the
        call's results."""
        self.padded += (padded,)
        self._plans.clear()
        return len(self.lowered.outputs) + len(self.padded) - 1

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.failed:
            return self._unfused(*inputs)
        try:
            outputs = self._launch(*inputs)
        except Exception as error:  # a kernel that fails to build or run, on any call, must not break the model
            self.on_failure(error)  # strict: raises, here and on every later call
            self.failed = True
            return self._unfused(*inputs)
        if self.on_first_run is not None:
            on_first_run, self.on_first_run = self.on_first_run, None
            on_first_run(lambda: self._launch(*inputs), lambda: self._unfused(*inputs))
        return outputs

    def _unfused(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = tuple(self.fallback(*inputs))
        return (*outputs, *(p.of(outputs[p.output]) for p in self.padded))

    def _written_strides(self, strides: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """The outputs' strides, those written into a padded buffer as they lie in it."""
        written = list(strides)
        for p in self.padded:
            written[p.output] = p.strides
        return tuple(written)

    def __repr__(self) -> str:
        return self.__name__

    def _launch(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = tuple((t.shape, t.stride()) for t in inputs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(inputs)
        layouts = self.lowered.outputs
        buffers = tuple(torch.empty(p.shape, dtype=layouts[p.output].dtype, device=self.device) for p in self.padded)
        in_buffers = {}  # an output written padded is a view of its buffer, never a tensor of its own
        for p, buffer in zip(self.padded, buffers):
            if tuple(plan.out_shapes[p.output]) != p.output_shape:
                raise RuntimeError(f"output {p.output} of shape {plan.out_shapes[p.output]}, planned to be written "
                                   f"padded at {p.output_shape}")
            in_buffers[p.output] = buffer.as_strided(p.output_shape, p.strides)
        outputs = tuple(in_buffers[i] if i in in_buffers else
                        torch.empty_strided(shape, strides, dtype=layout.dtype, device=self.device)
                        for i, (shape, strides, layout) in enumerate(zip(plan.out_shapes, plan.out_strides, layouts)))
        if plan.grid[0] == 0:
            for p, buffer in zip(self.padded, buffers):
                p.zero_pads(buffer)
            if plan.scratch is not None:
                plan.scratch.finish(plan.scratch.written(outputs), outputs)
            return (*outputs, *buffers)
        pointers = [inputs[a.input].item() if a.by_value else inputs[a.input] for a in self.lowered.accesses]

        def launches() -> None:
            for p, buffer in zip(self.padded, buffers):
                p.zero_pads(buffer)
            if plan.scratch is None:
                plan.launch(plan.grid, *pointers, *outputs)
                return
            written = plan.scratch.written(outputs)
            plan.launch(plan.grid, *pointers, *written)
            plan.scratch.finish(written, outputs)

        if self.replay and pointwise_replays.can_replay(outputs[0]):
            # Scalars by repr: -0.0 and 0.0, True and 1 are equal keys but other launches.
            tensors = [p for p in pointers if isinstance(p, torch.Tensor)]
            values = (plan.serial, *(repr(p) for p in pointers if not isinstance(p, torch.Tensor)))
            # The plan (its serial among the values) is that of the inputs' shapes and strides and fixes the
            # outputs' layouts; the graph fixes every dtype: the tensors enter the key by pointer alone.
            pointwise_replays.run((), values, launches, (*tensors, *outputs, *buffers))
        else:
            launches()
        return (*outputs, *buffers)

    def _plan(self, inputs: Sequence[torch.Tensor]) -> LaunchPlan:
        lowered = self.lowered
        accesses = lowered.accesses
        root = resolved_root(lowered, inputs)
        out_strides = self._written_strides(tuple(contiguous_strides(root, out.stride_order)
                                                  for out in lowered.outputs))
        if 0 in root:  # nothing to compute: empty outputs, no launch
            return LaunchPlan(None, (root,) * len(out_strides), out_strides, (0,))
        tensor_loads = [k for k, a in enumerate(accesses) if not a.by_value]
        load_strides = {k: strides_at(accesses[k].map, inputs[accesses[k].input].stride(), lowered.rank)
                        for k in tensor_loads}
        operands = [load_strides[k][0] for k in tensor_loads] + list(out_strides)
        guarded = [guard.dim for guard in lowered.program.guards]
        sizes, strides, position = _coalesce(root, lowered.outputs[0].stride_order, operands, guarded)

        load_dims, load_base, int_args = [], [], list(sizes)
        for k in range(len(accesses)):
            if k in load_strides:
                st = strides[tensor_loads.index(k)]
                base = load_strides[k][1]
                load_dims.append(tuple(s != 0 for s in st))
                load_base.append(base != 0)
                int_args += [s for s in st if s != 0] + ([base] if base else [])
            else:
                load_dims.append((False,) * len(sizes))
                load_base.append(False)
        output_dims = []
        for st in strides[len(tensor_loads):]:
            output_dims.append(tuple(s != 0 for s in st))
            int_args += [s for s in st if s != 0]

        extent = max([sum((n - 1) * abs(s) for n, s in zip(sizes, st)) for st in strides] + [0])
        numel = 1
        for n in sizes:
            numel *= n
        wide = max(extent + max((abs(load_strides[k][1]) for k in tensor_loads), default=0), numel) > INT32_MAX
        hungry = any(step.target.overloadpacket in REGISTER_HUNGRY for step in lowered.program.steps)
        xblock, yblock, num_warps = choose_blocks(sizes, hungry)
        x_blocks, y_blocks = (cdiv(numel // sizes[-1], xblock), cdiv(sizes[-1], yblock)) if numel else (0, 0)
        grid_2d = len(sizes) > 1 and x_blocks <= MAX_GRID_Y
        grid = (y_blocks, x_blocks) if grid_2d else (x_blocks * y_blocks,)
        even = numel > 0 and sizes[-1] % yblock == 0 and (numel // sizes[-1]) % xblock == 0
        variant = Variant(len(sizes), tuple(load_dims), tuple(load_base), tuple(output_dims), wide, grid_2d, even,
                          tuple(position[d] for d in guarded))
        kernel = compiled_kernel(self.__name__, lowered.program, variant,
                                 lambda: kernel_source(self.__name__, lowered.program, variant))
        launch = BoundLaunch(kernel, len(accesses) + len(out_strides), bound_args=tuple(int_args), XBLOCK=xblock,
                             YBLOCK=yblock, num_warps=num_warps)
        return LaunchPlan(launch, (root,) * len(out_strides), out_strides, grid)


def resolved_root(lowered: Lowered, inputs: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The root shape of this call: symbolic sizes read off the inputs."""
    return tuple(size if isinstance(size, int) else int(inputs[lowered.accesses[size[0]].input].shape[size[1]])
                 for size in lowered.root_shape)


def warn_fallback(name: str, error: Exception) -> None:
    warnings.warn(f"fusepass: kernel {name} failed ({type(error).__name__}: {error}); "
                  "running its ops unfused", RuntimeWarning, stacklevel=3)
