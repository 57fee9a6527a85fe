"""An attention op at run time: its kernels launched, or replayed as a CUDA graph, on each call's tensors.

An `AttentionCall` holds what a spec needs beyond its static plan: the ops it replaced (the fallback, `Unfused`),
its score functions compiled on first use, the extents of the block map the forward returns (per dtype and
device), and whether its kernels' compiles were started. The compiled graph names the spec; `call_named` finds
the call.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusepass.attention import sdpa_floor
from fusepass.attention.document_mask import document_ids, document_masked, documents_causal
from fusepass.attention.key_mask import kept_keys, key_masked
from fusepass.attention.known_contents import ContentGuard, ContentsChanged
from fusepass.attention.plan import AttentionSpec
from fusepass.attention.sdpa_floor import (Decision, SdpaRun, causal_band, decision, in_a_backward, layout_class,
                                           sdpa_causal, sdpa_form, shape_named)
from fusepass.attention.unfused import Unfused, contiguous_strides, with_strides
from fusepass.codegen.modules import load_module
from fusepass.flash.ahead import compile_attention_ahead
from fusepass.flash.backward import backward_map, flash_attention_backward
from fusepass.flash.blockmap import BlockMap, capturing, map_extent, packed_map_numel
from fusepass.flash.config import FlashConfig, forward_config, kind_block_m, narrow_kv_tiles, tile_width
from fusepass.flash.forward import FlashForwardExtra, flash_attention_forward, forward_outputs, keeps_residual
from fusepass.flash import hopper_backward, hopper_forward
from fusepass.flash.score_mod import ScoreMod, SeparableKeep
from fusepass.report import profile
from fusepass.report.records import KERNEL, SDPA
from fusepass.runtime.replay import attention_replays
from fusepass.runtime.timing import random_like, timing_generator

# out, lse, log_sum, the fallback rows, the output's rounding residual (`keeps_residual`; empty where none), the map
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]


class AttentionCall:
    def __init__(self, spec: AttentionSpec, unfused: Unfused, guards: Sequence[ContentGuard] = ()) -> None:
        self.spec = spec
        self.unfused = unfused  # the replaced ops, over the op's inputs (q, k, v sources, aux, what else they read)
        self.guards = tuple(guards)  # of the buffers the score functions compute in place of reading them
        self.compiled_ahead = False  # whether a call has started compiling the kernels (`compile_attention_ahead`)
        self.sdpa = sdpa_form(spec)  # the SDPA call that computes the attention, if one does (`sdpa_floor`)
        self.key_masked = key_masked(spec)  # whether its mask is of the keys alone (`key_mask`)
        self.document_masked = document_masked(spec)  # or of document ids (`document_mask`)
        # per layout and dtype of q, k, v: `_choice`'s
        self._choices: dict[tuple, tuple[SdpaRun | None, bool | None, int | None]] = {}
        self._documents_causal_at: dict[tuple[int, int], bool | None] = {}  # per (q length, kv length)
        self._mod: ScoreMod | None = None
        self._passed_maps: dict[tuple[torch.dtype, torch.device], tuple] = {}

    # ------------------------------------------------------------------------------- the spec's kernel inputs

    @property
    def mod(self) -> ScoreMod:
        """The score functions, compiled on first use (``triton.jit`` reads them from a file)."""
        if self._mod is None:
            spec, lifted = self.spec, self.spec.lifted
            module = load_module(lifted.source)
            fns = {k: getattr(module, v) for k, v in lifted.functions.items()}
            self._mod = ScoreMod(
                name=spec.name, score=fns["score"], score_grad=fns["score_grad"], keep=fns.get("keep"),
                fill=fns.get("fill"), fill_grad=fns.get("fill_grad"), fill_bound=lifted.fill_bound,
                has_aux_grad=any(lifted.aux_needs_grad),
                keep_uses_batch="b" in lifted.keep_uses, keep_uses_head="h" in lifted.keep_uses,
                keep_reads_aux=lifted.keep_reads_aux,
                separable_keep=None if lifted.separable is None else SeparableKeep(
                    lifted.separable.equal, fns["keep_rows"], fns["keep_cols"], self._others_mod(fns)),
                tables=tuple((getattr(module, t.function),
                              getattr(module, t.offset_function) if t.offset_function else None, t)
                             for t in lifted.tables),
                linear_scale=lifted.linear_scale)
        return self._mod

    def _others_mod(self, fns: dict) -> ScoreMod | None:
        """The masks joined with a separable one, as a keep of its own (its map cached per shape), or None."""
        separable = self.spec.lifted.separable
        if separable.others is None:
            return None
        uses = separable.others_uses
        return ScoreMod(name=f"{self.spec.name}_others", score=None, score_grad=None, keep=fns["keep_others"],
                        keep_uses_batch="b" in uses, keep_uses_head="h" in uses)

    def passed_map(self, q: torch.Tensor) -> tuple[FlashConfig, int, tuple[int, int, int, int, int]] | None:
        """Where the op returns the forward's block map: the forward's tiles, as `flash_attention_forward` takes
        them for a mask whose rows are not known, the q extent of the map's kinds (`kind_block_m`) and the map's
        extent (see `blockmap.map_shapes`). Asked on every call, worked out once per dtype and device. `q`: the
        op's input."""
        spec = self.spec
        if not spec.passes_map:
            return None
        key = (q.dtype, q.device)
        if key not in self._passed_maps:
            width = tile_width(spec.q.size[3], spec.v.size[3])
            tiles = narrow_kv_tiles(forward_config(width, q.dtype, True, q.device), None)
            kinds_at = kind_block_m(tiles, width, q.dtype, q.device)
            batch, heads, q_len, _ = spec.out_shape
            uses = spec.lifted.keep_uses
            extent = map_extent(batch if "b" in uses else 1, heads if "h" in uses else 1, q_len, spec.k.size[2],
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

    def views(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: Sequence[torch.Tensor]):
        """The kernels' [B, H, N, D] views of the op's q, k, v sources; the aux tensors checked against the strides
        the score functions were compiled for."""
        spec = self.spec
        for tensor, strides in zip(aux, spec.aux_strides):
            if tuple(tensor.stride()) != strides:
                raise RuntimeError(f"fusepass attention {spec.name}: a score input has strides {tensor.stride()}, "
                                   f"compiled for {strides}")
        return spec.q.view(q), spec.k.view(k), spec.v.view(v)

    # ------------------------------------------------------------------------------- forward and backward

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: list[torch.Tensor],
                seed: torch.Tensor) -> Outputs:
        """(out [B, H, Nq, D], lse, log of the row sums, rows recomputed without tile skipping, the forward's block
        map where it is not cached: see `map_shapes`)."""
        s, unfused = self.spec, self.unfused
        try:
            for guard in () if unfused.failed else self.guards:
                guard.check(aux)
        except ContentsChanged as error:  # the kernels compute what the buffer held: the replaced ops read it
            unfused.fail(error, "forward")
        if unfused.failed:
            return self._unfused_forward((q, k, v, *aux), seed)
        q4, k4, v4 = self.views(q, k, v, aux)
        read = tuple(aux[:len(s.aux_strides)])
        try:
            sdpa, hopper, _ = (None, None, None) if self.sdpa is None else self._choice(q4, k4, v4)
        except Exception as error:  # the floor's timing runs the kernels: one that fails must not break the model
            unfused.fail(error, "forward")
            return self._unfused_forward((q, k, v, *aux), seed)
        if sdpa is not None:
            return self._sdpa_forward(sdpa, q4, k4, v4)

        def forward(outputs: tuple, packed_map: Sequence[torch.Tensor] = ()):
            if not self.compiled_ahead:
                self.compiled_ahead = True
                _compile_ahead(self, (q, k, v), (q4, k4, v4), aux, q.device)
            map_into = self.block_map(packed_map[0], q) if packed_map else None
            self._fused_forward(q4, k4, v4, s.kernel_aux(read), seed, outputs, map_into, hopper)

        try:
            # Everything the call returns is allocated here, outside the launches a replay repeats (the map's
            # views are made inside: a replayed call needs only its buffer).
            outputs = forward_outputs(q4, self.mod, s.out_dtype, q.device, s.out_by_position, self.keeps_residual(),
                                      v4.shape[3])
            packed_map = [torch.empty(shape, dtype=torch.int32, device=q.device) for shape in self.map_shapes(q)]
            if s.replay and attention_replays.can_replay(q):
                # The outputs' layouts follow from the spec (named by the values) and q, k, v: keyed by pointer (the
                # seed too: its kernels read it there).
                attention_replays.run((q4, k4, v4, *read, seed), (s.name,),
                                      lambda: forward(outputs, packed_map),
                                      [t for t in (*outputs, *packed_map) if t is not None])
            else:
                forward(outputs, packed_map)
            out, lse, log_sum, fallback_rows, residual = outputs
        except Exception as error:  # a kernel that fails to build or run must not break the model
            unfused.fail(error, "forward")
            return self._unfused_forward((q, k, v, *aux), seed)
        if unfused.profiling and profile.can_profile(q.device) and not unfused.profiled_forward:
            unfused.profiled_forward = True
            # the same outputs written again: the same values
            profile.measure(unfused.forward_record, lambda: forward(outputs, packed_map),
                            lambda: unfused.forward((q, k, v, *aux), _seed(seed)))
        fallback = fallback_rows if fallback_rows is not None else lse.new_empty(0, dtype=torch.int8)
        return out, lse, log_sum, fallback, residual if residual is not None else out.new_empty(0), packed_map

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, log_sum: torch.Tensor, fallback: torch.Tensor,
                 residual: torch.Tensor, block_map: list[torch.Tensor], aux: list[torch.Tensor], seed: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Gradients of the sources of q, k, v (empty for one that another's buffer holds: `gradient_owners`) and of
        every aux tensor (zeros where none flows, empty where the spec says none does)."""
        s, unfused = self.spec, self.unfused
        inputs = (q, k, v, *aux)
        if unfused.failed:
            return self._unfused_backward(inputs, grad_out, seed)
        q4, k4, v4 = self.views(q, k, v, aux)
        read = tuple(aux[:len(s.aux_strides)])
        needs = s.aux_needs_grad(len(aux))

        grads = gradient_buffers(s, (q, k, v))
        if self.sdpa is not None and SdpaRun.ran(lse):
            SdpaRun.backward(grad_out, lse, (s.q.view(grads[0]), s.k.view(grads[1]), s.v.view(grads[2])))
            return self._owned(grads) + ([],)

        def new_aux_grad() -> tuple[torch.Tensor, ...]:
            """fp32 accumulators for the aux tensors a gradient flows to, laid out as they are (the score
            functions' gradients add at the offsets they load from); an empty stand-in for the others."""
            return tuple(_accumulator(a) if n else a.new_empty(0) for a, n in zip(read, needs))

        def backward(aux_grad: tuple[torch.Tensor, ...]) -> None:
            # The forward's map, where the op returned one, viewed here: a replayed call needs only its buffer.
            extra = FlashForwardExtra(log_sum, fallback if fallback.numel() else None,
                                      self.block_map(block_map[0], q) if block_map else None,
                                      residual if residual.numel() else None)
            _, hopper, window = self._choices.get(self._layouts(q4, k4, v4), (None, None, None))
            self._fused_backward(grad_out, q4, k4, v4, out, lse, extra, s.kernel_aux(read), s.kernel_aux_grad(aux_grad),
                                 (s.q.view(grads[0]), s.k.view(grads[1]), s.v.view(grads[2])), hopper, seed, window)

        aux_grad = new_aux_grad()
        try:
            if s.replay and attention_replays.can_replay(q):
                # The gradients' layouts follow from q, k, v's (seen through the spec's views) and the aux tensors'.
                attention_replays.run((grad_out, q4, k4, v4, out, lse, log_sum, fallback, residual, *block_map, *read,
                                       seed), (s.name,), lambda: backward(aux_grad), (*aux_grad, *grads))
            else:
                backward(aux_grad)
        except Exception as error:  # as in the forward: the replaced ops take over
            if s.dropout_p:
                # The kernel's forward dropped other elements than the replaced ops would.
                raise RuntimeError("fusepass: the attention backward kernel failed after its forward had run with "
                                   "dropout; no gradient consistent with that forward can be computed") from error
            unfused.fail(error, "backward")
            return self._unfused_backward(inputs, grad_out, seed)
        record = unfused.backward_record
        if unfused.profiling and profile.can_profile(q.device) and record is not None and \
                not unfused.profiled_backward:
            unfused.profiled_backward = True
            profile.measure_backward(record, lambda: backward(new_aux_grad()),
                                     lambda: unfused.gradients(inputs, grad_out, _seed(seed)),
                                     unfused.forward_record.measured_unfused_ms or 0.0)
        aux_grads = [_aux_gradient(g, a) if g.numel() else g for g, a in zip(aux_grad, read)] + \
            [a.new_empty(0) for a in aux[len(read):]]
        return self._owned(grads) + (aux_grads,)

    def _owned(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q's, K's and V's gradients as the op returns them: empty for one that another's buffer holds."""
        owners = self.spec.gradient_owners
        return tuple(g if owner == i else g.new_empty(0) for i, (g, owner) in enumerate(zip(grads, owners)))

    # ------------------------------------------------------------------------------- SDPA, where faster

    def _fused_forward(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, aux: tuple,
                       seed: torch.Tensor | None, outputs: tuple, map_into: BlockMap | None,
                       hopper: bool | None) -> None:
        """The fused forward into `outputs` (`forward_outputs`): the sm_90 kernel's where `hopper` says it serves
        (and whether causal), else the Triton kernel's."""
        if hopper is not None:
            out, lse, log_sum, fallback_rows, residual = outputs
            hopper_forward.hopper_forward(q4, k4, v4, out, lse, log_sum, fallback_rows, self.sdpa.scale, hopper,
                                          residual)
            return
        s = self.spec
        flash_attention_forward(q4, k4, v4, self.mod, aux, dropout_p=s.dropout_p, seed=seed, out_dtype=s.out_dtype,
                                outputs=outputs, map_into=map_into)

    def _fused_backward(self, grad_out: torch.Tensor, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, extra: FlashForwardExtra, aux: tuple,
                        aux_grad: tuple | None, grads: tuple, hopper: bool | None, seed: torch.Tensor | None,
                        window: int | None = None) -> None:
        """The fused backward into `grads`: the sm_90 kernel's where the forward was the sm_90 kernel's (`hopper`, as
        `_choice` gives it), or after the Triton forward where the mask is a sliding window's band (`window`), of the
        keys alone (`key_mask`) or of document ids (`document_mask`), with the exact weights and
        `hopper_backward.serves`, else the Triton kernels'."""
        s = self.spec
        causal = True if window is not None else hopper
        after_triton = causal is None and s.out_dtype == q4.dtype
        keyed = after_triton and self.key_masked
        documents = after_triton and self.document_masked
        if keyed:
            causal = False
        elif documents:  # (the mask checked only where the kernel can run)
            causal = self._documents_causal(q4, k4) if hopper_backward.available(q4.device) else None
        if causal is not None and extra.residual is not None and \
                hopper_backward.serves(grad_out, q4, k4, v4, causal, window, keyed, documents):
            mod = self.mod
            batch = q4.shape[0] if mod.keep_uses_batch else 1
            kept = kept_keys(mod.keep, aux, batch, k4.shape[2], hopper_backward.BLOCK_N, q4.device) if keyed else None
            hopper_backward.hopper_backward(grad_out, q4, k4, v4, out, lse, extra.log_sum, s.lifted.linear_scale,
                                            causal, grads, extra.residual, window=window, kept=kept,
                                            documents=self._document_ids(q4, k4, aux, extra) if documents else None)
            record = self.unfused.backward_record
            if record is not None:
                record.detail.setdefault(KERNEL, {})[shape_named(q4)] = hopper_backward.DESCRIBED
            return
        flash_attention_backward(grad_out, q4, k4, v4, out, lse, extra, self.mod, aux, aux_grad, dropout_p=s.dropout_p,
                                 seed=seed, grads=grads)

    def _documents_causal(self, q4: torch.Tensor, k4: torch.Tensor) -> bool | None:
        """`document_mask.documents_causal` at these lengths, evaluated once per pair of lengths, outside a CUDA
        graph's capture (None there where not yet known: the Triton backward serves it)."""
        lengths = q4.shape[2], k4.shape[2]
        if lengths not in self._documents_causal_at:
            if capturing(q4.device):
                return None
            self._documents_causal_at[lengths] = documents_causal(self.mod.separable_keep, self.spec.kernel_aux(()),
                                                                  *lengths, q4.device)
        return self._documents_causal_at[lengths]

    def _document_ids(self, q4: torch.Tensor, k4: torch.Tensor, aux: tuple, extra: FlashForwardExtra
                      ) -> hopper_backward.DocumentIds:
        """What the sm_90 backward reads of a `document_masked` attention's mask at this call: both sides' ids, the
        block map at its tiles (the forward's where it serves them), and which heads hold a row that keeps no key."""
        mod = self.mod
        batch, _, q_len, _ = q4.shape
        kv_len = k4.shape[2]
        rows, cols = document_ids(mod.separable_keep, aux, batch if mod.keep_uses_batch else 1, q_len, kv_len,
                                  q4.device)
        block_map = backward_map(mod, aux, extra, q4, kv_len, hopper_backward.BLOCK_M, hopper_backward.BLOCK_N, True)
        return hopper_backward.DocumentIds(rows, cols, mod.separable_keep.equal, block_map,
                                           extra.fallback_rows.amax(-1))

    @staticmethod
    def _layouts(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> tuple:
        """What `_choice` decides by: q's, k's and v's shapes, strides, dtype and device."""
        return q4.shape, q4.stride(), k4.shape, k4.stride(), v4.shape, v4.stride(), q4.dtype, q4.device

    def _choice(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor
                ) -> tuple[SdpaRun | None, bool | None, int | None]:
        """(SDPA in place of the fused kernels or None; whether the fused forward is the sm_90 kernel's and causal,
        or None where it is the Triton kernel's; the width of the sliding window whose backward is the sm_90
        kernel's, or None) for an attention of the form SDPA computes (`self.sdpa`): SDPA where the floor is on, its
        mask is checked to be what SDPA computes at each layout, and it was measured faster (`sdpa_floor`, timed once
        per class of layouts); the sm_90 kernel where `hopper_forward.serves`; a window where its mask is checked to
        be a causal band (`sdpa_floor.causal_band`) and `hopper_backward.serves` it. Asked on every call, decided
        once per layout."""
        layouts = self._layouts(q4, k4, v4)
        if layouts not in self._choices:
            run, hopper, window = None, None, None
            s = self.spec
            if sdpa_floor.can_time(q4.device) and q4.dtype == s.out_dtype:
                causal = self.sdpa.masked and sdpa_causal(self.mod.keep, s.kernel_aux(()), q4.shape[2],
                                                          k4.shape[2], q4.device)
                if causal is None and hopper_backward.WINDOWS and hopper_backward.available(q4.device) and \
                        hopper_forward.serves(q4, k4, v4, True):
                    window = causal_band(self.mod.keep, s.kernel_aux(()), q4.shape[2], k4.shape[2], q4.device)
                if causal is not None:
                    where = shape_named(q4)
                    # The forward's map, where the op returns it, is the Triton forward's to build.
                    if not s.passes_map and hopper_forward.serves(q4, k4, v4, causal):
                        hopper = causal
                    if s.sdpa:
                        gradients = any(self.unfused.requires_grad)
                        key = (self.sdpa, causal, hopper is not None, self.mod.mask_functions, s.out_by_position,
                               gradients, *map(layout_class, (q4, k4, v4)), q4.dtype, q4.device)
                        found = decision(key, lambda: self._sdpa_decision(causal, hopper, q4, k4, v4, gradients))
                        self.unfused.forward_record.detail.setdefault(SDPA, {})[where] = \
                            found.describe(gradients, where)
                        run = SdpaRun(self.sdpa, causal) if found.runs_sdpa else None
                    if hopper is not None and run is None:
                        self.unfused.forward_record.detail.setdefault(KERNEL, {})[where] = \
                            hopper_forward.DESCRIBED
            self._choices[layouts] = run, hopper, window
        return self._choices[layouts]

    def _sdpa_decision(self, causal: bool, hopper: bool | None, q4: torch.Tensor, k4: torch.Tensor,
                       v4: torch.Tensor, gradients: bool) -> Decision:
        """SDPA's and the fused kernels' times at these layouts, where SDPA computes the attention (`causal`: with
        its causal mask), on random tensors laid out as these."""
        s = self.spec
        aux = s.kernel_aux(())
        run = SdpaRun(self.sdpa, causal)
        q, k, v = (random_like(x) for x in (q4, k4, v4))
        out_strides = self._out_strides()
        grad_out = torch.empty_strided(s.out_shape, out_strides, dtype=q.dtype, device=q.device) \
            .normal_(generator=timing_generator(q.device))
        grads = tuple(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in (q, k, v))

        def sdpa_step() -> None:
            lse = q.new_empty(s.out_shape[:3], dtype=torch.float32)
            run.forward(q, k, v, out_strides, lse, gradients)
            if gradients:  # as in a training step: inside autograd's backward
                in_a_backward(lambda: run.backward(grad_out, lse, grads), q.device)

        def fused_step() -> None:
            outputs = forward_outputs(q, self.mod, s.out_dtype, q.device, s.out_by_position, gradients, v.shape[3])
            self._fused_forward(q, k, v, aux, None, outputs, None, hopper)
            if gradients:
                out, lse, log_sum, fallback_rows, residual = outputs
                self._fused_backward(grad_out, q, k, v, out, lse,
                                     FlashForwardExtra(log_sum, fallback_rows, None, residual), aux,
                                     s.kernel_aux_grad(()), grads, hopper, None)

        return Decision(causal, *sdpa_floor.timed(sdpa_step, fused_step), measured_at=shape_named(q4))

    def _sdpa_forward(self, run: SdpaRun, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> Outputs:
        """The op's outputs with SDPA's result; the lse a stand-in that names the kept forward (`SdpaRun.ran`)."""
        s = self.spec
        lse = q4.new_empty(s.out_shape[:3], dtype=torch.float32)
        out = run.forward(q4, k4, v4, self._out_strides(), lse, any(self.unfused.requires_grad))
        fallback = lse.new_empty(s.fallback_shape, dtype=torch.int8)
        return out, lse, torch.empty_like(lse), fallback, self._no_residual(out), []

    def keeps_residual(self) -> bool:
        """Whether the op returns its output's rounding residual (`forward.keeps_residual`): for a backward."""
        return any(self.unfused.requires_grad) and keeps_residual(self.spec.out_dtype)

    def _no_residual(self, out: torch.Tensor) -> torch.Tensor:
        """The residual of a forward whose backward does not read it (SDPA's, the replaced ops'): laid out as the
        fake lays it out, never written."""
        return torch.empty_like(out) if self.keeps_residual() else out.new_empty(0)

    def _out_strides(self) -> tuple[int, ...]:
        """Of the op's output, as `forward_outputs` lays it out."""
        b, h, n, d = self.spec.out_shape
        return (n * h * d, d, h * d, 1) if self.spec.out_by_position else (h * n * d, n * d, d, 1)

    # ------------------------------------------------------------------------------- the replaced ops

    def _unfused_forward(self, inputs: tuple[torch.Tensor, ...], seed: torch.Tensor) -> Outputs:
        """The op's outputs from the replaced ops: their result, and row statistics the backward then ignores."""
        s = self.spec
        out = self.unfused.to_canonical(self.unfused.forward(inputs, _seed(seed)), s.out_shape)
        if s.out_by_position:  # as the fake lays it out
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        rows = s.out_shape[:3]
        fallback = out.new_zeros(s.fallback_shape, dtype=torch.int8)
        block_map = [out.new_zeros(shape, dtype=torch.int32) for shape in self.map_shapes(inputs[0])]
        return (out, out.new_zeros(rows, dtype=torch.float32), out.new_zeros(rows, dtype=torch.float32), fallback,
                self._no_residual(out), block_map)

    def _unfused_backward(self, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor, seed: torch.Tensor):
        """The op's gradients from the replaced ops, differentiated by autograd, laid out as the kernels' are."""
        found = self.unfused.gradients(inputs, grad_out, _seed(seed))
        q_k_v = [with_strides(g if g is not None else torch.zeros_like(x), x.stride())
                 for g, x in zip(found[:3], inputs[:3])]
        for i, owner in enumerate(self.spec.gradient_owners):  # one buffer holds the gradients of one source
            if owner != i:
                q_k_v[owner] = q_k_v[owner] + q_k_v[i]
                q_k_v[i] = q_k_v[i].new_empty(0)
        needs = self.spec.aux_needs_grad(len(inputs) - 3)
        aux = [with_strides(g if g is not None else torch.zeros_like(x), contiguous_strides(x)) if n
               else x.new_empty(0) for g, x, n in zip(found[3:], inputs[3:], needs)]
        return q_k_v[0], q_k_v[1], q_k_v[2], aux

    # ------------------------------------------------------------------------------- compiles ahead

    def compile_ahead_of_first_call(self, sources: Sequence[torch.Tensor], aux: Sequence[torch.Tensor]) -> None:
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
                _compile_ahead(self, (q, k, v), self.views(q, k, v, read), read, device)
            except Exception:
                pass


def _compile_ahead(call: AttentionCall, sources: tuple[torch.Tensor, ...], qkv: tuple[torch.Tensor, ...],
                   aux: Sequence[torch.Tensor], device: torch.device) -> None:
    """Start compiling the kernels of the forward and, where a gradient flows, of the backward, the gradients
    laid out as `AttentionCall.backward` writes them (their sources' strides, seen through the op's views), to run
    on `device`."""
    s = call.spec
    read = tuple(aux[:len(s.aux_strides)])
    grads = aux_grad = None
    if any(call.unfused.requires_grad):
        grads = tuple(layout.view(g) for layout, g in zip((s.q, s.k, s.v), gradient_buffers(s, sources, "meta")))
        aux_grad = tuple(  # as `backward` lays them out
            _accumulator(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")) if n
            else torch.empty(0, dtype=a.dtype, device="meta") for a, n in zip(read, s.aux_needs_grad(len(read))))
    compile_attention_ahead(*qkv, call.mod, s.kernel_aux(read), dropout_p=s.dropout_p, out_dtype=s.out_dtype,
                            forward_tiles=s.forward_tiles if device.type == "cuda" else None, grads=grads,
                            aux_grad=None if aux_grad is None else s.kernel_aux_grad(aux_grad), device=device)


def gradient_buffers(s: AttentionSpec, sources: Sequence[torch.Tensor], device: str | None = None
                     ) -> list[torch.Tensor]:
    """The buffers Q's, K's and V's gradients are written into, through the views the op reads, laid out as their
    sources (on `device` where given: "meta" stand-ins): one per owner (`AttentionSpec.gradient_owners`), zeroed
    where its views leave elements unwritten."""
    buffers: list[torch.Tensor] = []
    for i, (x, layout, owner) in enumerate(zip(sources, (s.q, s.k, s.v), s.gradient_owners)):
        if owner != i:  # its views and the owner's tile the source
            buffers.append(buffers[owner])
            continue
        buffer = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device or x.device)
        if not layout.covers(buffer.numel()) and s.gradient_owners.count(i) == 1:
            buffer.zero_()
        buffers.append(buffer)
    return buffers


def _seed(seed: torch.Tensor) -> int:
    return int(seed.item()) if seed.numel() else 0


# By name, weakly: a call lives as long as the graphs that name it hold it (`fx_util.hold`), so that compiled
# functions dropped (torch._dynamo.reset()) leave nothing behind.
_calls: weakref.WeakValueDictionary[str, AttentionCall] = weakref.WeakValueDictionary()


def register(call: AttentionCall) -> str:
    _calls[call.spec.name] = call
    return call.spec.name


def call_named(name: str) -> AttentionCall:
    return _calls[name]


def _accumulator(a: torch.Tensor) -> torch.Tensor:
    """Zeros of `a`'s shape and strides in float32, over as much memory as `a`'s strides reach: a slice of a larger
    tensor keeps its row stride, a permuted one its order, a broadcast dim its stride 0."""
    extent = 1 + sum((n - 1) * stride for n, stride in zip(a.shape, a.stride()))
    return torch.zeros(extent if a.numel() else 0, dtype=torch.float32, device=a.device).as_strided(a.shape,
                                                                                                  a.stride())


def _aux_gradient(accumulated: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The gradient of aux tensor `a` from its accumulator, contiguous in `a`'s dtype (as the fake lays it out).
    Positions of `a` that share memory (a stride 0 along a broadcast dim) share one sum: it goes to the first of
    them, zeros to the others, which is what the broadcast's own backward adds up."""
    shared = [d for d, (n, stride) in enumerate(zip(a.shape, a.stride())) if stride == 0 and n > 1]
    if not shared:
        return accumulated.to(dtype=a.dtype, memory_format=torch.contiguous_format)
    first = tuple(slice(0, 1) if d in shared else slice(None) for d in range(a.dim()))
    gradient = torch.zeros(a.shape, dtype=a.dtype, device=a.device)
    gradient[first] = accumulated[first]
    return gradient
