"""``torch.ops.fusepass.attention``: the fused attention as a torch.library custom op with its own backward.

The graph calls it with the tensors the user's Q, K and V were viewed from (``layout``), the tensors the
score functions read (``aux``), a seed tensor (dropout) and the name of its ``AttentionSpec``, which holds
everything static: the layouts, the lifted score functions, shapes and dtypes. AOTAutograd sees an opaque
op with a fake implementation and a registered backward (itself a custom op), so the N×N probabilities
never exist, forward or backward.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusepass.attention.layout import OperandLayout
from fusepass.attention.lift import Lifted
from fusepass.codegen.modules import load_module
from fusepass.flash.ahead import compile_attention_ahead
from fusepass.flash.backward import flash_attention_backward
from fusepass.flash.blockmap import BlockMap, map_extent, packed_map_numel
from fusepass.flash.config import FlashConfig, forward_config, kind_block_m, narrow_kv_tiles
from fusepass.flash.forward import FlashForwardExtra, flash_attention_forward, forward_outputs
from fusepass.flash.score_mod import ScoreMod, SeparableKeep
from fusepass.report import profile
from fusepass.report.records import Rewrite
from fusepass.runtime.replay import attention_replays


@dataclass
class Unfused:
    """The ops the rewrite replaced, as a module of the op's inputs (q, k, v sources, aux, then anything
    else they read): what runs if the kernels fail (a warning and a hotspot; ``strict`` raises), and what
    ``FUSEPASS_PROFILE`` times the kernels against."""

    module: torch.fx.GraphModule  # -> (the matmul with V's output,)
    requires_grad: list[bool]  # per op input
    output_shape: tuple[int, ...]  # of the matmul with V
    out_perm: tuple[int, ...] | None  # its einsum order (the op's output is [B, H, Nq, D])
    on_failure: Callable[[Exception, str], None]  # (the error, "forward" or "backward")
    forward_record: Rewrite
    backward_record: Rewrite | None
    failed: bool = False
    # FUSEPASS_PROFILE as the rewrite found it: asked once, not on every call
    profiling: bool = field(default_factory=profile.requested)
    profiled_forward: bool = False
    profiled_backward: bool = False

    def fail(self, error: Exception, phase: str) -> None:
        """The kernels failed: report it (``strict`` raises here, and every later call tries the kernels again)
        and run the replaced ops from now on."""
        self.on_failure(error, phase)
        self.failed = True

    def to_canonical(self, out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The module's output laid out as the op's: [B, H, Nq, D], contiguous."""
        if self.out_perm is not None:
            out = out.permute([self.out_perm.index(i) for i in range(out.dim())])
        return out.reshape(shape).contiguous()

    def from_canonical(self, grad: torch.Tensor) -> torch.Tensor:
        """The op's output gradient laid out as the module's output."""
        if self.out_perm is None:
            return grad.reshape(self.output_shape)
        canonical = [0] * len(self.output_shape)
        for i, p in enumerate(self.out_perm):
            canonical[p] = self.output_shape[i]
        return grad.reshape(canonical).permute(self.out_perm)

    def forward(self, inputs: tuple[torch.Tensor, ...], seed: int) -> torch.Tensor:
        """The module's output; its random draws (dropout) seeded by the op's seed, so that the backward's
        second run draws the same."""
        devices = sorted({torch.cuda._utils._get_device_index(x.device) for x in inputs if x.is_cuda})
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            for index in devices:  # only the generators fork_rng restores
                torch.cuda.default_generators[index].manual_seed(seed)
            return self.module(*inputs)[0]

    def gradients(self, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, seed: int
                  ) -> list[torch.Tensor | None]:
        """Gradients of every input (None where none flows): the module run again under autograd."""
        with autograd_enabled():
            xs = [x.detach().requires_grad_(needs) for x, needs in zip(inputs, self.requires_grad)]
            wanted = [x for x in xs if x.requires_grad]
            found = iter(torch.autograd.grad(self.forward(tuple(xs), seed), wanted, self.from_canonical(grad),
                                             allow_unused=True) if wanted else ())
            return [next(found) if x.requires_grad else None for x in xs]


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Autograd inside a custom op's implementation, which runs below it."""
    excluded = torch._C._dispatch_tls_local_exclude_set() - torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), \
            torch.enable_grad():
        yield


@dataclass
class AttentionSpec:
    name: str
    q: OperandLayout
    k: OperandLayout
    v: OperandLayout
    lifted: Lifted
    out_dtype: torch.dtype
    dropout_p: float
    aux_strides: list[tuple[int, ...]]
    unfused: Unfused | None = None  # set by the rewrite, with the graph values it reads (after the aux)
    compiled_ahead: bool = False  # whether a call has started compiling the kernels (`compile_attention_ahead`)
    forward_tiles: FlashConfig | None = None  # set by the rewrite where the density model knows the mask's rows
    replay: bool = True  # replay launches as CUDA graphs where arguments repeat (`fusepass.runtime.replay`)
    _mod: ScoreMod | None = field(default=None, repr=False)
    _passed_maps: dict[tuple[torch.dtype, torch.device], tuple] = field(default_factory=dict, repr=False)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        batch, heads, q_len, _ = self.q.size
        return batch, heads * self.q.group, q_len, self.v.size[3]

    @property
    def fallback_shape(self) -> tuple[int, ...]:
        """Of the op's per-row flags of rows recomputed over all tiles: none without a mask."""
        return self.out_shape[:3] if self.lifted.functions.get("keep") else (0,)

    @property
    def passes_map(self) -> bool:
        """Whether the op returns the forward's block map: for a mask that reads tensors, mapped on every call,
        so that the backward need not map it again at the forward's tiles (other maps are cached)."""
        return bool(self.lifted.functions.get("keep")) and self.lifted.keep_reads_aux

    def passed_map(self, q: torch.Tensor) -> tuple[FlashConfig, int, tuple[int, int, int, int, int]] | None:
        """Where the op returns the forward's block map: the forward's tiles, as `flash_attention_forward` takes
        them for a mask whose rows are not known, the q extent of the map's kinds (`kind_block_m`) and the map's
        extent (see `blockmap.map_shapes`). Asked on every call, worked out once per dtype and device. `q`: the
        op's input."""
        if not self.passes_map:
            return None
        key = (q.dtype, q.device)
        if key not in self._passed_maps:
            head_dim = self.q.size[3]
            tiles = narrow_kv_tiles(forward_config(head_dim, q.dtype, True, q.device), None)
            kinds_at = kind_block_m(tiles, head_dim, q.dtype, q.device)
            batch, heads, q_len, _ = self.out_shape
            uses = self.lifted.keep_uses
            extent = map_extent(batch if "b" in uses else 1, heads if "h" in uses else 1, q_len, self.k.size[2],
                                tiles.block_m, tiles.block_n, kinds_at)
            self._passed_maps[key] = tiles, kinds_at, extent
        return self._passed_maps[key]

    def map_shapes(self, q: torch.Tensor) -> list[tuple[int, ...]]:
        """Of the forward's block map as the op returns it, or none: one int32 buffer (`BlockMap.from_packed`) that
        a call allocates, returns and saves for the backward. `q`: the op's input."""
        passed = self.passed_map(q)
        return [] if passed is None else [(packed_map_numel(passed[2]),)]

    def block_map(self, packed: torch.Tensor, q: torch.Tensor) -> BlockMap:
        """The forward's block map in the buffer `packed` (see `map_shapes`)."""
        tiles, kinds_at, extent = self.passed_map(q)
        return BlockMap.from_packed(tiles.block_m, tiles.block_n, kinds_at, packed, extent)

    def _others_mod(self, fns: dict) -> ScoreMod | None:
        """The masks joined with a separable one, as a keep of its own (its map cached per shape), or None."""
        if self.lifted.separable.others is None:
            return None
        uses = self.lifted.separable.others_uses
        return ScoreMod(name=f"{self.name}_others", score=None, score_grad=None, keep=fns["keep_others"],
                        keep_uses_batch="b" in uses, keep_uses_head="h" in uses)

    @property
    def mod(self) -> ScoreMod:
        """The score functions, compiled on first use (``triton.jit`` reads them from a file)."""
        if self._mod is None:
            module = load_module(self.lifted.source)
            fns = {k: getattr(module, v) for k, v in self.lifted.functions.items()}
            self._mod = ScoreMod(
                name=self.name, score=fns["score"], score_grad=fns["score_grad"], keep=fns.get("keep"),
                fill=fns.get("fill"), fill_grad=fns.get("fill_grad"), fill_bound=self.lifted.fill_bound,
                has_aux_grad=any(self.lifted.aux_needs_grad),
                keep_uses_batch="b" in self.lifted.keep_uses, keep_uses_head="h" in self.lifted.keep_uses,
                keep_reads_aux=self.lifted.keep_reads_aux,
                separable_keep=None if self.lifted.separable is None else SeparableKeep(
                    self.lifted.separable.equal, fns["keep_rows"], fns["keep_cols"], self._others_mod(fns)),
                tables=tuple((getattr(module, t.function),
                              getattr(module, t.offset_function) if t.offset_function else None, t)
                             for t in self.lifted.tables),
                linear_scale=self.lifted.linear_scale)
        return self._mod


# By name, weakly: a spec lives as long as the graphs that call it hold it (`fx_util.hold`), so that compiled
# functions dropped (torch._dynamo.reset()) leave nothing behind.
_specs: weakref.WeakValueDictionary[str, AttentionSpec] = weakref.WeakValueDictionary()


def register(spec: AttentionSpec) -> str:
    _specs[spec.name] = spec
    return spec.name


def spec_named(name: str) -> AttentionSpec:
    return _specs[name]


def _views(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: list[torch.Tensor]):
    for tensor, strides in zip(aux, spec.aux_strides):
        if tuple(tensor.stride()) != strides:
            raise RuntimeError(f"fusepass attention {spec.name}: a score input has strides {tensor.stride()}, "
                               f"compiled for {strides}")
    return spec.q.view(q), spec.k.view(k), spec.v.view(v)


def _seed(seed: torch.Tensor) -> int:
    return int(seed.item()) if seed.numel() else 0


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: list[torch.Tensor], seed: torch.Tensor,
                  spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(out [B, H, Nq, D], lse, log of the row sums, rows recomputed without tile skipping, the forward's block
    map where it is not cached: see `AttentionSpec.map_shapes`)."""
    s = _specs[spec]
    if s.unfused.failed:
        return _unfused_forward(s, (q, k, v, *aux), _seed(seed))
    q4, k4, v4 = _views(s, q, k, v, aux)
    read = tuple(aux[:len(s.aux_strides)])
    seed_value = _seed(seed)

    def forward(outputs: tuple | None = None, packed_map: Sequence[torch.Tensor] = ()):
        if not s.compiled_ahead:
            s.compiled_ahead = True
            _compile_ahead(s, (q, k, v), (q4, k4, v4), aux, q.device)
        map_into = s.block_map(packed_map[0], q) if packed_map else None
        return flash_attention_forward(q4, k4, v4, s.mod, read, dropout_p=s.dropout_p, seed=seed_value,
                                       out_dtype=s.out_dtype, outputs=outputs, map_into=map_into)

    try:
        # Everything the call returns is allocated here, outside the launches a replay repeats (the map's
        # views are made inside: a replayed call needs only its buffer).
        outputs = forward_outputs(q4, s.mod, s.out_dtype, q.device)
        packed_map = [torch.empty(shape, dtype=torch.int32, device=q.device) for shape in s.map_shapes(q)]
        if s.replay and attention_replays.can_replay(q):
            # The outputs' layouts follow from the spec (named by the values) and q, k, v: keyed by pointer.
            attention_replays.run((q4, k4, v4, *read), (s.name, seed_value), lambda: forward(outputs, packed_map),
                                  [t for t in (*outputs, *packed_map) if t is not None])
        else:
            forward(outputs, packed_map)
        out, lse, log_sum, fallback_rows = outputs
    except Exception as error:  # a kernel that fails to build or run must not break the model
        s.unfused.fail(error, "forward")
        return _unfused_forward(s, (q, k, v, *aux), seed_value)
    if s.unfused.profiling and profile.can_profile(q.device) and not s.unfused.profiled_forward:
        s.unfused.profiled_forward = True
        profile.measure(s.unfused.forward_record, forward,
                        lambda: s.unfused.forward((q, k, v, *aux), seed_value))
    fallback = fallback_rows if fallback_rows is not None else lse.new_empty(0, dtype=torch.int8)
    return out, lse, log_sum, fallback, packed_map


def compile_ahead_of_first_call(spec: AttentionSpec, sources: Sequence[torch.Tensor], aux: Sequence[torch.Tensor]
                                ) -> None:
    """At the rewrite: start compiling the op's kernels (`_compile_ahead`) from meta stand-ins of the graph's
    values of q, k, v and the score functions' inputs (fake tensors of their shapes and strides), for the
    device they are on. A failure here is left to the first call, which starts them again and reports what
    fails."""
    device = sources[0].device
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with unset_fake_temporarily(), on_device:
        q, k, v, *read = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                          for x in (*sources, *aux))
        try:
            _compile_ahead(spec, (q, k, v), _views(spec, q, k, v, read), read, device)
        except Exception:
            pass


def _compile_ahead(s: AttentionSpec, sources: tuple[torch.Tensor, ...], qkv: tuple[torch.Tensor, ...],
                   aux: Sequence[torch.Tensor], device: torch.device) -> None:
    """Start compiling the kernels of the forward and, where a gradient flows, of the backward, the gradients
    laid out as `run_attention_backward` writes them (their sources' strides, seen through the op's views), to
    run on `device`."""
    read = tuple(aux[:len(s.aux_strides)])
    grads = aux_grad = None
    if any(s.unfused.requires_grad):
        grads = tuple(layout.view(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta"))
                      for layout, x in zip((s.q, s.k, s.v), sources))
        aux_grad = tuple(torch.empty(a.shape if n else (0,), dtype=torch.float32 if n else a.dtype, device="meta")
                         for a, n in zip(read, _aux_needs_grad(s, len(read))))
    compile_attention_ahead(*qkv, s.mod, read, dropout_p=s.dropout_p, out_dtype=s.out_dtype,
                            forward_tiles=s.forward_tiles if device.type == "cuda" else None, grads=grads,
                            aux_grad=aux_grad, device=device)


def _unfused_forward(s: AttentionSpec, inputs: tuple[torch.Tensor, ...], seed: int):
    """The op's outputs from the replaced ops: their result, and row statistics the backward then ignores."""
    out = s.unfused.to_canonical(s.unfused.forward(inputs, seed), s.out_shape)
    rows = s.out_shape[:3]
    fallback = out.new_zeros(s.fallback_shape, dtype=torch.int8)
    block_map = [out.new_zeros(shape, dtype=torch.int32) for shape in s.map_shapes(inputs[0])]
    return (out, out.new_zeros(rows, dtype=torch.float32), out.new_zeros(rows, dtype=torch.float32), fallback,
            block_map)


# The op's implementation is also called directly by the compiled graphs (fusepass/runnable.py).
attention = torch.library.custom_op("fusepass::attention", run_attention, mutates_args=())


@attention.register_fake
def _attention_fake(q, k, v, aux, seed, spec):
    s = _specs[spec]
    shape = s.out_shape
    out = q.new_empty(shape, dtype=s.out_dtype)
    lse = q.new_empty(shape[:3], dtype=torch.float32)
    fallback = q.new_empty(s.fallback_shape, dtype=torch.int8)
    block_map = [q.new_empty(shape, dtype=torch.int32) for shape in s.map_shapes(q)]
    return out, lse, q.new_empty(shape[:3], dtype=torch.float32), fallback, block_map


def run_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, log_sum: torch.Tensor, fallback: torch.Tensor,
                           block_map: list[torch.Tensor], aux: list[torch.Tensor], seed: torch.Tensor, spec: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of the sources of q, k, v and of every aux tensor (zeros where none flows)."""
    s = _specs[spec]
    inputs = (q, k, v, *aux)
    if s.unfused.failed:
        return _unfused_backward(s, inputs, grad_out, _seed(seed))
    q4, k4, v4 = _views(s, q, k, v, aux)
    read = tuple(aux[:len(s.aux_strides)])
    needs = _aux_needs_grad(s, len(aux))

    # The gradients take their sources' strides, and the kernels write them through the views the op read.
    grads = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in (q, k, v)]
    for grad, layout in zip(grads, (s.q, s.k, s.v)):
        if not layout.covers(grad.numel()):
            grad.zero_()

    seed_value = _seed(seed)

    def new_aux_grad() -> tuple[torch.Tensor, ...]:
        """fp32 accumulators for the aux tensors a gradient flows to; an empty stand-in for the others."""
        return tuple(torch.zeros(a.shape, dtype=torch.float32, device=a.device) if n else a.new_empty(0)
                     for a, n in zip(read, needs))

    def backward(aux_grad: tuple[torch.Tensor, ...]) -> None:
        # The forward's map, where the op returned one, viewed here: a replayed call needs only its buffer.
        extra = FlashForwardExtra(log_sum, fallback if fallback.numel() else None,
                                  s.block_map(block_map[0], q) if block_map else None)
        flash_attention_backward(grad_out, q4, k4, v4, out, lse, extra, s.mod, read, aux_grad,
                                 dropout_p=s.dropout_p, seed=seed_value,
                                 grads=(s.q.view(grads[0]), s.k.view(grads[1]), s.v.view(grads[2])))

    aux_grad = new_aux_grad()
    try:
        if s.replay and attention_replays.can_replay(q):
            # The gradients' layouts follow from q, k, v's (seen through the spec's views) and the aux tensors'.
            attention_replays.run((grad_out, q4, k4, v4, out, lse, log_sum, fallback, *block_map, *read),
                                  (s.name, seed_value), lambda: backward(aux_grad), (*aux_grad, *grads))
        else:
            backward(aux_grad)
    except Exception as error:  # as in the forward: the replaced ops take over
        if s.dropout_p:
            # The kernel's forward dropped other elements than the replaced ops would.
            raise RuntimeError("fusepass: the attention backward kernel failed after its forward had run with "
                               "dropout; no gradient consistent with that forward can be computed") from error
        s.unfused.fail(error, "backward")
        return _unfused_backward(s, inputs, grad_out, seed_value)
    record = s.unfused.backward_record
    if s.unfused.profiling and profile.can_profile(q.device) and record is not None and not s.unfused.profiled_backward:
        s.unfused.profiled_backward = True
        profile.measure_backward(record, lambda: backward(new_aux_grad()),
                                 lambda: s.unfused.gradients(inputs, grad_out, seed_value),
                                 s.unfused.forward_record.measured_unfused_ms or 0.0)
    aux_grads = [g.to(a.dtype) for g, a in zip(aux_grad, read)] + [a.new_empty(0) for a in aux[len(read):]]
    return grads[0], grads[1], grads[2], aux_grads


attention_backward = torch.library.custom_op("fusepass::attention_backward", run_attention_backward,
                                            mutates_args=())


def with_strides(value: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """`value` laid out with `stride` (a copy where it is not): the layout a fake implementation promised, which
    the graph around the op was traced with."""
    if tuple(value.stride()) == tuple(stride):
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)


def _contiguous_strides(x: torch.Tensor) -> tuple[int, ...]:
    return torch.empty(x.shape, device="meta").stride()


def _unfused_backward(s: AttentionSpec, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor, seed: int):
    """The op's gradients from the replaced ops, differentiated by autograd, laid out as the kernels' are."""
    found = s.unfused.gradients(inputs, grad_out, seed)
    q_k_v = [with_strides(g if g is not None else torch.zeros_like(x), x.stride())
             for g, x in zip(found[:3], inputs[:3])]
    needs = _aux_needs_grad(s, len(inputs) - 3)
    aux = [with_strides(g if g is not None else torch.zeros_like(x), _contiguous_strides(x)) if n else x.new_empty(0)
           for g, x, n in zip(found[3:], inputs[3:], needs)]
    return q_k_v[0], q_k_v[1], q_k_v[2], aux


def _aux_needs_grad(spec: AttentionSpec, count: int) -> list[bool]:
    """Which aux inputs get a gradient: those the score functions read and a gradient flows to (the
    other graph values the replaced ops read, passed for them, get none)."""
    needs = list(spec.lifted.aux_needs_grad)
    return needs + [False] * (count - len(needs))


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, log_sum, fallback, block_map, aux, seed, spec):
    needs = _aux_needs_grad(_specs[spec], len(aux))
    # As `run_attention_backward` lays them out: the sources' strides (the kernels write through the op's views
    # of them), the aux gradients contiguous.
    return (*(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in (q, k, v)),
            [a.new_empty(a.shape) if n else a.new_empty(0) for a, n in zip(aux, needs)])


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, aux, seed, spec = inputs
    out, lse, log_sum, fallback, block_map = output
    ctx.save_for_backward(q, k, v, out, lse, log_sum, fallback, seed, *block_map, *aux)
    ctx.spec = spec


def _backward(ctx: Any, grad_out: torch.Tensor, *unused: Any):
    q, k, v, out, lse, log_sum, fallback, seed, *rest = ctx.saved_tensors
    n_map = 1 if _specs[ctx.spec].passes_map else 0
    block_map, aux = rest[:n_map], rest[n_map:]
    dq, dk, dv, daux = attention_backward(grad_out.contiguous(), q, k, v, out, lse, log_sum, fallback,
                                          list(block_map), list(aux), seed, ctx.spec)
    return dq, dk, dv, [g if g.numel() else None for g in daux], None, None


attention.register_autograd(_backward, setup_context=_setup_context)
