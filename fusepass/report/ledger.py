"""HBM bytes and flops: the ops a rewrite replaces, run one by one, versus the kernel that replaces them.

docs/report.md states every formula of this file; tests/report/test_ledger.py checks them by hand.

Ops one by one (``bytes_unfused``, ``flops``):
- an op reads each tensor input once and writes its output once; a view (its value aliases an input)
  moves nothing; a broadcast (stride-0) dimension counts once: a tensor's bytes are the elements it holds;
- dropout also writes its keep mask (one byte per element);
- a matmul is 2·M·N·K flops, a softmax 3 per element (max, exp and sum, divide: the seeds' count), any
  other op 1 per output element.
Their backward, as eager autograd runs it, for each op whose output a gradient flows to: a matmul
C = A·B computes dA = dC·Bᵀ and dB = Aᵀ·dC (each reads dC and the other operand, writes its gradient), a
softmax reads dY and Y and writes dX (4 flops per element), dropout reads dY and its mask and writes dX,
any other op moves what its forward moves.

A fused elementwise kernel reads each external input once and writes each output once (that is also its
ideal). The flash-attention kernels' tiling model is in the second half of this file.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from fusepass.report.records import Rewrite

aten = torch.ops.aten
MATMULS = frozenset({aten.matmul, aten.mm, aten.bmm})
BIASED_MATMULS = frozenset({aten.addmm, aten.baddbmm})  # input + mat1 · mat2
SOFTMAXES = frozenset({aten.softmax, aten._softmax})
DROPOUTS = frozenset({aten.dropout, aten.native_dropout})
SOFTMAX_FLOPS = 3  # per element: max, exp and sum, divide
SOFTMAX_BACKWARD_FLOPS = 4  # per element: dY·Y, its row sum, subtract, times Y
STAT_BYTES = 4  # one fp32 per query row: lse, log_sum, delta


# ---------------------------------------------------------------------------------------------------
# Ops one by one


def _int(size: object) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


def numel(val: object) -> int:
    return math.prod(_int(s) for s in val.shape) if isinstance(val, torch.Tensor) else 0


def tensor_bytes(val: object) -> int:
    """The bytes a tensor holds: its broadcast (stride-0) dimensions count once."""
    if not isinstance(val, torch.Tensor):
        return 0
    held = math.prod(_int(n) for n, s in zip(val.shape, val.stride()) if _int(s) != 0)
    return held * val.element_size()


def value_bytes(node: torch.fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))


def _packet(node: torch.fx.Node) -> object:
    return getattr(node.target, "overloadpacket", None)


def aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose memory ``node``'s value is a view of, if any."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    for arg in node.all_input_nodes:
        arg_val = arg.meta.get("val")
        if isinstance(arg_val, torch.Tensor) and torch._C._is_alias_of(val, arg_val):
            return arg
    return None


def is_view(node: torch.fx.Node) -> bool:
    """Moves no bytes: a view of an input, or an element of a tuple an op returned."""
    return node.op == "call_function" and (node.target is operator.getitem or aliased_input(node) is not None)


def _dropout_mask_bytes(node: torch.fx.Node) -> int:
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return numel(node.meta.get("val")) if _packet(node) in DROPOUTS and training else 0


def op_bytes(node: torch.fx.Node) -> int:
    """Bytes one op moves on its own: its tensor inputs read, its output written."""
    if is_view(node):
        return 0
    return sum(value_bytes(a) for a in node.all_input_nodes) + value_bytes(node) + _dropout_mask_bytes(node)


def is_matmul(node: torch.fx.Node) -> bool:
    return _packet(node) in MATMULS or _packet(node) in BIASED_MATMULS


def _operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A matmul's two factors."""
    return (node.args[1], node.args[2]) if _packet(node) in BIASED_MATMULS else (node.args[0], node.args[1])


def _matmul_flops(node: torch.fx.Node) -> int:
    left = _operands(node)[0].meta.get("val")
    return 2 * numel(node.meta.get("val")) * _int(left.shape[-1])


def op_flops(node: torch.fx.Node) -> int:
    if is_view(node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return 0
    if is_matmul(node):
        return _matmul_flops(node)
    per_element = SOFTMAX_FLOPS if _packet(node) in SOFTMAXES else 1
    return per_element * numel(node.meta.get("val"))


def unfused_bytes(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(op_bytes(n) for n in nodes)


def unfused_flops(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(op_flops(n) for n in nodes)


def fused_bytes(inputs: Iterable[torch.fx.Node], outputs: Iterable[torch.fx.Node]) -> int:
    return sum(value_bytes(n) for n in inputs) + sum(value_bytes(n) for n in outputs)


def op_name(node: torch.fx.Node) -> str:
    """``aten.matmul``, ``fusepass.attention``, or a launcher's kernel name."""
    packet = _packet(node)
    if packet is not None:
        return packet._qualified_op_name.replace("::", ".")
    return getattr(node.target, "__name__", str(node.target))


def _needs_grad(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and bool(node.meta.get("requires_grad", False))


@dataclass(frozen=True)
class BackwardOp:
    """One op eager autograd runs for the backward of a forward op."""

    name: str
    bytes: int
    flops: int
    matmul: bool = False


def backward_ops(node: torch.fx.Node) -> list[BackwardOp]:
    """What the backward of ``node`` runs, as eager autograd runs it; none for views and for ops no
    gradient flows to."""
    if not _needs_grad(node) or is_view(node):
        return []
    out = value_bytes(node)
    if is_matmul(node):
        left, right = _operands(node)
        flops = _matmul_flops(node)
        ops = [BackwardOp("aten.matmul", out + value_bytes(other) + value_bytes(operand), flops, matmul=True)
               for operand, other in ((right, left), (left, right)) if _needs_grad(operand)]
        if _packet(node) in BIASED_MATMULS and _needs_grad(node.args[0]):  # the added input's gradient
            ops.append(BackwardOp(op_name(node), out + value_bytes(node.args[0]), numel(node.meta["val"])))
        return ops
    if _packet(node) in SOFTMAXES:
        return [BackwardOp("aten._softmax_backward_data", 2 * out + value_bytes(node.args[0]),
                           SOFTMAX_BACKWARD_FLOPS * numel(node.meta["val"]))]
    if _dropout_mask_bytes(node):
        return [BackwardOp("aten.native_dropout_backward", op_bytes(node), numel(node.meta["val"]))]
    return [BackwardOp(op_name(node), op_bytes(node), numel(node.meta.get("val")))]


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``node``'s value lives in (through views)."""
    while (source := aliased_input(node)) is not None:
        node = source
    return node


def saved_for_backward(node: torch.fx.Node) -> tuple[list[torch.fx.Node], int]:
    """(values eager autograd keeps from the forward for ``node``'s backward, bytes of tensors it keeps that
    are no graph value). A lower bound: an op that keeps its own result (a softcap's tanh) is not counted."""
    if not _needs_grad(node) or is_view(node):
        return [], 0
    if is_matmul(node):
        left, right = _operands(node)
        return [other for operand, other in ((left, right), (right, left)) if _needs_grad(operand)], 0
    if _packet(node) in SOFTMAXES:
        return [node], 0
    mask = _dropout_mask_bytes(node)
    if mask:
        return [], mask
    # A mask or a constant operand is read again by the backward.
    return [a for a in node.all_input_nodes if not _needs_grad(a) and isinstance(a.meta.get("val"), torch.Tensor)
            and a.meta["val"].dim() > 0], 0


def elementwise_rewrite(phase: str, location: str, ops: tuple[str, ...], compute_nodes: Sequence[torch.fx.Node],
                        inputs: Sequence[torch.fx.Node], outputs: Sequence[torch.fx.Node],
                        detail: dict) -> Rewrite:
    fused = fused_bytes(inputs, outputs)
    flops = unfused_flops(compute_nodes)
    return Rewrite(kind="elementwise", phase=phase, location=location, ops=ops,
                   bytes_unfused=unfused_bytes(compute_nodes), bytes_fused=fused, bytes_ideal=fused, flops=flops,
                   flops_fused=flops, detail=detail)


# ---------------------------------------------------------------------------------------------------
# The flash-attention kernels' tiling model
#
# Tile sizes are the CUDA configs of fusepass/flash/config.py, also when the graph runs on the
# CPU: HBM traffic is a GPU's. A GPU runs a kernel's programs in waves of about one per SM, in grid order
# (the first grid axis fastest). The programs of one wave that read the same tensor share it through L2
# (they walk it in the same order at about the same pace), so a tensor read by `n` consecutive programs
# comes from HBM about 1 + (n - 1)/SMs times (its waves, averaged over where the wave boundaries fall).
#
# Forward, grid (q block, query head, batch): each program reads its Q rows once, the K and V tiles of
# each kv block its block map lists, and writes its output rows and two fp32 row statistics (lse,
# log_sum; with a mask also one int8 fallback flag per row). The `group · ⌈Nq/BLOCK_M⌉` programs of the
# query heads sharing a kv head read its K and V: once per wave.
#
# Backward: a preprocessing kernel reads O and dO and writes delta (fp32 per row). The dK/dV kernel, grid
# (kv block, kv head, batch), reads its K and V tiles once, and for each query head sharing its kv head
# the Q and dO rows and row statistics (lse, log_sum, delta) of the q blocks listed for its kv block —
# once per wave of the ⌈Nk/BLOCK_N⌉ programs of a kv head — and writes dK and dV. The dQ kernel, grid
# (q block, query head, batch), reads Q, dO and the statistics once, K and V as the forward does, and
# writes dQ. Each kernel at its own tiles (and density); dQ, dK, dV are written straight into the layouts
# of the tensors they are gradients of.
#
# Aux tensors (masks, biases, tables the score functions read): one with at least Nq·Nk elements (a
# dense mask or bias) is loaded tile by tile by every query head's programs, for each visited tile; a
# smaller one (padding mask, ALiBi slopes, bias table) is read once per kernel. The backward reads them
# in both kernels; an aux gradient accumulates atomically in fp32 (each visited tile read and written)
# into a zero-filled buffer, then is converted to the tensor's dtype.
#
# Density: the fraction of score tiles the block map lists (it scales the flops and the aux tiles).
# Known for a causal mask over a square score matrix (the tiles on or below the diagonal); 1 for any
# other mask (its density is only known at run time) and without one.


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int  # query heads
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    itemsize: int  # of Q, K and V
    out_itemsize: int
    masked: bool  # the score chain has a mask (the forward writes per-row fallback flags)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def rows(self) -> int:
        """Query rows over every batch and head."""
        return self.batch * self.heads * self.q_len

    @property
    def kv_rows(self) -> int:
        return self.batch * self.kv_heads * self.kv_len

    @property
    def scores(self) -> int:
        """Score elements over every batch and head."""
        return self.batch * self.heads * self.q_len * self.kv_len


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    density: float  # fraction of score tiles the kernel visits
    model: str  # how the density was found
    concurrent: int  # programs in flight (one per SM)
    known: bool = True  # False: the density is a stand-in, the mask's tiles are only known at run time

    def q_blocks(self, shape: AttentionShape) -> int:
        return -(-shape.q_len // self.block_m)

    def kv_blocks(self, shape: AttentionShape) -> int:
        return -(-shape.kv_len // self.block_n)

    def waves(self, programs: int) -> float:
        """How many times a tensor that ``programs`` consecutive programs read comes from HBM."""
        return 1 + (programs - 1) / self.concurrent


@dataclass(frozen=True)
class AuxRead:
    """A tensor the score functions read."""

    bytes: int  # the elements it holds
    itemsize: int
    per_tile: bool  # a dense mask or bias: loaded tile by tile
    needs_grad: bool


def causal_tile_fraction(n: int, block_m: int, block_n: int) -> float:
    """The fraction of BLOCK_M × BLOCK_N tiles of an n × n score matrix that hold a kept element of a
    causal mask (key ≤ query): q block i reaches the kv block of its last row."""
    q_blocks, kv_blocks = -(-n // block_m), -(-n // block_n)
    visited = sum((min((i + 1) * block_m, n) - 1) // block_n + 1 for i in range(q_blocks))
    return visited / (q_blocks * kv_blocks)


def tile_density(features: Sequence[str], skips_tiles: bool, q_len: int, kv_len: int, block_m: int,
                 block_n: int, concurrent: int) -> Tiles:
    """``skips_tiles``: the kernels may skip masked tiles (there is a mask, and its fill is bounded)."""
    if not skips_tiles:
        return Tiles(block_m, block_n, 1.0, "every tile: none can be skipped", concurrent)
    if "causal" in features and "window" not in features and q_len == kv_len:
        return Tiles(block_m, block_n, causal_tile_fraction(q_len, block_m, block_n), "causal tiles", concurrent)
    return Tiles(block_m, block_n, 1.0, "mask density unknown before run time: every tile counted", concurrent,
                 known=False)


def _aux_tiles(shape: AttentionShape, tiles: Tiles, aux: Sequence[AuxRead]) -> float:
    """Bytes one kernel reads of the aux tensors."""
    return sum(shape.scores * tiles.density * a.itemsize if a.per_tile else a.bytes for a in aux)


def _kv_reads(shape: AttentionShape, tiles: Tiles) -> float:
    """K and V as the forward and the dQ kernel read them: once per wave of a kv head's programs."""
    return 2 * shape.kv_rows * shape.head_dim * shape.itemsize * tiles.waves(shape.group * tiles.q_blocks(shape))


FORWARD_KERNEL = "_flash_forward_kernel"
DKDV_KERNEL, DQ_KERNEL = "_flash_backward_dkdv_kernel", "_flash_backward_dq_kernel"
TORCH_OPS = "torch ops around the kernels"  # aux gradient buffers: zero-filled fp32, then cast


def attention_forward_bytes(shape: AttentionShape, tiles: Tiles, aux: Sequence[AuxRead]
                            ) -> tuple[dict[str, float], int]:
    """(bytes the forward moves, by kernel; ideal bytes: Q, K, V and aux read once, O written once)."""
    d, es, oes = shape.head_dim, shape.itemsize, shape.out_itemsize
    q_and_out = shape.rows * d * (es + oes)
    stats = shape.rows * (2 * STAT_BYTES + (1 if shape.masked else 0))
    kernel = q_and_out + _kv_reads(shape, tiles) + stats + _aux_tiles(shape, tiles, aux)
    ideal = q_and_out + 2 * shape.kv_rows * d * es + sum(a.bytes for a in aux)
    return {FORWARD_KERNEL: kernel}, ideal


def attention_backward_bytes(shape: AttentionShape, dkdv_tiles: Tiles, dq_tiles: Tiles, aux: Sequence[AuxRead]
                             ) -> tuple[dict[str, float], int]:
    """(bytes the backward moves, by kernel; ideal bytes: Q, K, V, O, dO and aux read once, dQ, dK, dV and
    aux gradients written once). Each kernel at its own tiles."""
    d, es, oes = shape.head_dim, shape.itemsize, shape.out_itemsize
    q_rows, kv_rows = shape.rows, shape.kv_rows
    row = d * (es + oes) + 3 * STAT_BYTES  # a query row of Q and dO, and its lse, log_sum, delta
    with_grad = [a for a in aux if a.needs_grad]
    # Aux gradients: atomic fp32 updates of each visited tile in the dK/dV kernel (read and written), a
    # zero-filled fp32 buffer before it, a conversion to the tensor's dtype after it.
    atomics = sum((shape.scores * dkdv_tiles.density if a.per_tile else a.bytes // a.itemsize) * 2 * 4
                  for a in with_grad)
    buffers = sum(a.bytes // a.itemsize * (4 + 4 + a.itemsize) for a in with_grad)
    parts = {
        DKDV_KERNEL: 4 * kv_rows * d * es + q_rows * row * dkdv_tiles.waves(dkdv_tiles.kv_blocks(shape))
        + _aux_tiles(shape, dkdv_tiles, aux) + atomics,
        # dQ also reads O, for delta = rowsum(dO · O), which it writes for dK/dV (in `row`, read there).
        DQ_KERNEL: q_rows * (row + d * oes) + _kv_reads(shape, dq_tiles) + q_rows * d * es
        + _aux_tiles(shape, dq_tiles, aux),
    }
    if buffers:
        parts[TORCH_OPS] = buffers
    ideal = 2 * (q_rows + 2 * kv_rows) * d * es + 2 * q_rows * d * oes \
        + sum(a.bytes * (2 if a.needs_grad else 1) for a in aux)
    return parts, ideal


def _saved_bytes(nodes: Iterable[torch.fx.Node], kept_by_kernel: set[torch.fx.Node]) -> int:
    """Bytes of the values ``nodes`` keep for the backward, each storage once, beyond what stays alive
    anyway (graph inputs) or what the fused op keeps too (its operands and aux tensors)."""
    roots: dict[torch.fx.Node, int] = {}
    extra = 0
    for node in nodes:
        saved, unnamed = saved_for_backward(node)
        extra += unnamed
        for value in saved:
            root = storage_root(value)
            if root.op == "call_function" and root not in kept_by_kernel:
                roots[root] = value_bytes(root)
    return sum(roots.values()) + extra


def attention_rewrites(location: str, replaced: Sequence[torch.fx.Node], kept_by_kernel: Sequence[torch.fx.Node],
                       shape: AttentionShape, forward_tiles: Tiles, backward_tiles: tuple[Tiles, Tiles],
                       aux: Sequence[AuxRead], features: tuple[str, ...], detail: dict,
                       gradient_flows: bool) -> list[Rewrite]:
    """The forward record of one attention rewrite and, when a gradient flows, its backward record.

    ``replaced``: the ops the rewrite removes, in graph order (the matched ones and those only they used,
    such as a mask's construction); ``kept_by_kernel``: the tensors the fused op reads; ``backward_tiles``:
    the dK/dV kernel's and the dQ kernel's."""
    compute = [n for n in replaced if not is_view(n)]
    flops = unfused_flops(compute)
    elementwise_flops = flops - sum(op_flops(n) for n in compute if is_matmul(n))
    parts, ideal = attention_forward_bytes(shape, forward_tiles, aux)
    row_stats = shape.rows * (2 * STAT_BYTES + (1 if shape.masked else 0))
    activation = 0
    if gradient_flows:
        # The fused op keeps its output and row statistics instead.
        kept_instead = shape.rows * shape.head_dim * shape.out_itemsize + row_stats
        activation = _saved_bytes(compute, set(kept_by_kernel)) - kept_instead
    forward = Rewrite(
        kind="attention", phase="forward", location=location, ops=tuple(op_name(n) for n in compute),
        bytes_unfused=unfused_bytes(compute), bytes_fused=round(sum(parts.values())), bytes_ideal=ideal,
        flops=flops, flops_fused=round(flops * forward_tiles.density), activation_bytes_saved=activation,
        features=features, detail={**detail, **_model_detail(forward_tiles, parts)})
    if not gradient_flows:
        return [forward]
    backward = [op for n in reversed(compute) for op in backward_ops(n)]
    backward_elementwise = sum(op.flops for op in backward if not op.matmul)
    dkdv_tiles, dq_tiles = backward_tiles
    parts, ideal = attention_backward_bytes(shape, dkdv_tiles, dq_tiles, aux)
    # Both backward kernels recompute the scores and weights of each tile they visit; dK/dV adds dP, dV, dK
    # (8 flops per score per head-dim element in all), dQ adds dP and dQ (6).
    per_kernel = elementwise_flops + backward_elementwise
    recomputed = (8 * shape.scores * shape.head_dim + per_kernel) * dkdv_tiles.density \
        + (6 * shape.scores * shape.head_dim + per_kernel) * dq_tiles.density
    tiles = {"tiles": {"dk_dv": _tiles_detail(dkdv_tiles), "dq": _tiles_detail(dq_tiles)}}
    return [forward, Rewrite(
        kind="attention", phase="backward", location=location, ops=tuple(op.name for op in backward),
        bytes_unfused=sum(op.bytes for op in backward), bytes_fused=round(sum(parts.values())), bytes_ideal=ideal,
        flops=sum(op.flops for op in backward), flops_fused=round(recomputed),
        features=features, detail={**detail, **_model_detail(forward_tiles, parts), **tiles})]


def _tiles_detail(tiles: Tiles) -> dict:
    return {"block_m": tiles.block_m, "block_n": tiles.block_n, "density": round(tiles.density, 4),
            "density_model": tiles.model, "concurrent_programs": tiles.concurrent}


def _model_detail(tiles: Tiles, parts: dict[str, float]) -> dict:
    return {"tiles": _tiles_detail(tiles), "bytes_fused_by_kernel": {name: round(b) for name, b in parts.items()}}
