"""Attention whose sizes are symbolic (Dynamo recompiled it for varying shapes): rewritten per size at run time.

Layouts, score functions and tiles all depend on sizes, so a symbolic graph cannot be planned once. Its
attention is cut out instead, as a module of the ops it replaces, and called through
``torch.ops.fusepass.attention_dynamic``. On the first call at a concrete size the op traces that module at
it and runs the ordinary, static rewrite on the trace; later calls at that size reuse the result. The
backward traces nothing more: where gradients flow, the forward keeps what its backward reads, named by a
token the op returns beside the output (AOTAutograd saves it for the backward): the static op's outputs, where
the plan is that op alone on the op's tensors (`direct_plan`), else the autograd graph of the plan run under
autograd, which the backward differentiates through the static op's own backward. The forward does not run
again.

Planned once at compile time too, at the sizes Dynamo saw: that plan must rewrite the attention (else
the symbolic graph keeps it unfused, with the reason) and gives the report its figures.

Attentions alike share their plans (`PlanTable`): the layers of a stack cut out the same module (its ops, the
constants it holds, how values flow), from one source line, in one compile, so a new size is planned once for all
of them, not once a layer, and the compile plans only the first (the others' records are copies of its). A buffer
each layer holds for itself (nanoGPT's `tril`) is guarded per tensor (`ContentGuard` tracks each it meets), and by
its layer: one that changes takes that layer out of the shared plans.
"""
from __future__ import annotations

import copy
import operator
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch._dynamo.convert_frame import compile_lock
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fusepass.attention.direct_plan import DirectPlan, direct_plan
from fusepass.attention.kept_forwards import keep_forward, kept_forward
from fusepass.attention.known_contents import (KNOWN, Band, ContentGuard, ContentsChanged, KnownInput, band_of,
                                               known_input)
from fusepass.attention.layout import Unsupported, walk_up
from fusepass.attention.match import AttentionMatch
from fusepass.attention.other_lengths import AtLengths, hint, other_lengths, size_at
from fusepass.attention.subgraph import removed_nodes, replaced_subgraph, subgraph_module, with_built_from_sizes
from fusepass.attention.unfused import autograd_enabled, with_strides
from fusepass.capture import mark_requires_grad
from fusepass.context import PassContext, mark_planned
from fusepass.fx_util import hold, infer_meta, val
from fusepass.options import Options
from fusepass.report.records import KNOWN_CONTENTS, SDPA, Hotspot, Rewrite
from fusepass.report.report import Report
from fusepass.source import keep_location

aten = torch.ops.aten
Signature = tuple
PLANS = 16  # plans kept per attention (a backward whose forward's plan was dropped plans it again)


@dataclass(frozen=True)
class StaticPlan:
    """The attention at one size: the module traced there with its attention rewritten, the strides of the
    replaced ops' output there (what the fake implementation returns), and the module's direct form, if any."""
    module: torch.fx.GraphModule
    out_strides: tuple[int, ...]
    direct: DirectPlan | None


@dataclass
class DynamicSpec:
    name: str
    module: torch.fx.GraphModule  # (*tensors, *sizes) -> (the matmul with V's output,)
    requires_grad: list[bool]  # per tensor input: whether a gradient flows to it (`gradients_reach`)
    options: Options
    static_rewrite: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]  # the attention pass
    # per tensor input: the buffer it is, where the compile could read its contents (`known_contents`)
    known: list[KnownInput | None] = field(default_factory=list)
    report: Report | None = None  # the compile's, where a kernel failing at a size planned at run time is recorded
    location: str = ""  # the user's source line of the attention
    records: list[Rewrite] = field(default_factory=list)  # the compile's records of the attention's forward
    table: PlanTable = field(default_factory=lambda: PlanTable())  # its plans, shared by the attentions alike
    # Of its buffers read as the band they held at the compile: one that changes takes it out of the table it
    # shares (`_leave_table`), not the layers alike out of their kernels.
    guards: list[ContentGuard] = field(default_factory=list)

    @property
    def plans(self) -> OrderedDict[Signature, StaticPlan]:
        return self.table.plans

    @staticmethod
    def key(tensors: list[torch.Tensor], sizes: list[int]) -> Signature:
        return tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors) + tuple(sizes)

    def static(self, tensors: list[torch.Tensor], sizes: list[int]) -> StaticPlan:
        """The plan at these sizes; one per size, the `PLANS` most recently used kept."""
        try:
            for guard in self.guards:
                guard.check(tensors)
        except ContentsChanged as error:
            self._leave_table(error)
        key = self.key(tensors, sizes)
        plan = self.plans.get(key)
        if plan is None:
            # Tracing is not thread-safe (torch.fx keeps a global "is tracing" flag that two traces at once leave
            # set, failing every later torch.compile): a plan traces under Dynamo's own lock, as its compiles do.
            with compile_lock, autograd_enabled():  # planning traces the score chain's derivative
                plan = self.plans.get(key)
                if plan is None:
                    module, report, out_strides = plan_static(self, tensors, sizes)
                    self._record_unfused(report, sizes)
                    self._share_sdpa_detail(report)
                    plan = self.plans[key] = StaticPlan(module, out_strides, direct_plan(module))
                    if len(self.plans) > PLANS:
                        self.plans.popitem(last=False)
        self.plans.move_to_end(key)
        return plan

    def _leave_table(self, error: ContentsChanged) -> None:
        """A buffer read as its contents changed: planned apart from the layers alike from now on (its plans read
        the buffer as it is), with a warning (`strict`: an error)."""
        if self.options.strict:
            raise error
        reason = f"{error}; planned again apart from the layers alike, reading it as it is"
        warnings.warn(f"fusepass: {self.name} at {self.location}: {reason}", RuntimeWarning, stacklevel=3)
        if self.report is not None:
            self.report.hotspots.append(Hotspot(kind="attention", phase="forward", location=self.location,
                                                reason=reason))
        self.table, self.guards = PlanTable(), []

    def _share_sdpa_detail(self, report: Report) -> None:
        """What a plan's attention says of SDPA at its size (`sdpa_floor`) is said in the compile's record (the
        records of the attentions alike share it)."""
        planned = [r for r in report.rewrites if r.kind == "attention" and r.phase == "forward"]
        for plan_record, compile_record in zip(planned, self.records):
            plan_record.detail[SDPA] = compile_record.detail.setdefault(SDPA, {})

    def join(self, form: tuple, records: list[Rewrite], bands: list[Band | None]) -> None:
        """Share the plans of the attentions alike compiled before it (`PlanTable`), or start their table with its
        compile `records`; guard the `bands` its buffers hold (`_held_bands`)."""
        table = _tables.setdefault(form, self.table)
        if table is not self.table:
            self.table = table
            for record, shared in zip(self.records, table.records):
                record.detail[SDPA] = shared.detail.setdefault(SDPA, {})
        else:
            table.records, table.compile_records = self.records, records
        table.members.append(weakref.ref(self))
        for i, (known, band) in enumerate(zip(self.known, bands)):  # a guard's message names each layer's buffer
            if band is not None:
                self.guards.append(ContentGuard(i, known, band))
            if known is not None:
                table.buffer_names.setdefault(i, []).append(known.name)
                alike = _alike(table.buffer_names[i])
                for member in filter(None, (ref() for ref in table.members)):
                    member.known[i] = replace(member.known[i], name=alike)

    def _record_unfused(self, report: Report, sizes: list[int]) -> None:
        """A size at which the attention, rewritten at the sizes Dynamo saw, is not: it runs unfused there, which
        the compile's report must say (strict: an error)."""
        if any(r.kind == "attention" for r in report.rewrites):
            return
        reasons = [h.reason for h in report.hotspots if h.kind in ("attention", "fallback")]
        reason = f"not rewritten at sizes {sizes}: {reasons[0] if reasons else 'no attention matched'}"
        if self.options.strict:
            raise Unsupported(f"{self.name}: {reason}")
        warnings.warn(f"fusepass: {self.name} at {self.location}: {reason}; running it unfused", RuntimeWarning,
                      stacklevel=2)
        if self.report is not None and all(h.reason != reason for h in self.report.hotspots):  # once per size
            self.report.hotspots.append(Hotspot(kind="attention", phase="forward", location=self.location,
                                                reason=reason))


# By name, weakly, as the static specs (`op._specs`): held by the graphs that call them.
_specs: weakref.WeakValueDictionary[str, DynamicSpec] = weakref.WeakValueDictionary()


class PlanTable:
    """The plans of attentions alike, by the sizes and layouts of a call (the `PLANS` most recently used), and
    the attentions that share them."""

    def __init__(self) -> None:
        self.plans: OrderedDict[Signature, StaticPlan] = OrderedDict()
        self.members: list[weakref.ref] = []  # the specs that share it
        self.records: list[Rewrite] = []  # the first one's forward records, whose SDPA detail the others' share
        self.compile_records: list[Rewrite] = []  # the first one's records at the sizes its compile saw
        self.buffer_names: dict[int, list[str]] = {}  # per input read as its contents, each member's buffer


# By form (`_form`), weakly: held by the specs that share it.
_tables: weakref.WeakValueDictionary[tuple, PlanTable] = weakref.WeakValueDictionary()


def _form(spec: DynamicSpec, report: Report, at_compile: Signature, bands: list[Band | None]) -> tuple | None:
    """What decides an attention's plans: its module's structure (ops, their constant arguments, the constants it
    holds by identity, which values flow where), which inputs a gradient flows to, which are buffers read as their
    contents and the `bands` they hold (a plan computes a band where the tensor is read: a stack's local and global
    masks plan apart), the options, the source line, the compile's `report`, and the inputs' layouts and sizes at
    the compile (`DynamicSpec.key`: the compile's records are shared too). None where a constant argument cannot be
    compared (its plans are its own)."""
    index: dict[torch.fx.Node, int] = {}
    ops = []
    for i, node in enumerate(spec.module.graph.nodes):
        index[node] = i
        target = id(getattr(spec.module, node.target)) if node.op == "get_attr" else node.target
        ops.append((node.op, target, _comparable(node.args, index), _comparable(node.kwargs, index)))
    form = (tuple(ops), tuple(spec.requires_grad), tuple(k is not None for k in spec.known), tuple(bands),
            spec.options, spec.location, id(report), at_compile)
    try:
        hash(form)
    except TypeError:
        return None
    return form


def _comparable(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    """`value` (an op's arguments) as a hashable value, nodes by their position in the graph."""
    if isinstance(value, torch.fx.Node):
        return ("node", index[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_comparable(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _comparable(v, index)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", *(_comparable(v, index) for v in (value.start, value.stop, value.step)))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    return value


def _as_member(record: Rewrite, table: PlanTable, spec: DynamicSpec) -> Rewrite:
    """A compile record of the first attention of `table` as `spec`'s own: the buffers it names, `spec`'s."""
    copied = copy.deepcopy(record)
    named = copied.detail.get(KNOWN_CONTENTS)
    if named:
        own = {table.buffer_names[i][0]: known.name for i, known in enumerate(spec.known) if known is not None}
        copied.detail[KNOWN_CONTENTS] = {own.get(name, name): band for name, band in named.items()}
    return copied


def _held_bands(known: list[KnownInput | None]) -> list[Band | None]:
    """The band each input read as its contents holds at the compile, or None."""
    tensors = [k.tensor() if k is not None else None for k in known]
    return [band_of(t) if t is not None else None for t in tensors]


def _alike(names: list[str]) -> str:
    """One name for the buffers the attentions alike read at one place."""
    if len(set(names)) == 1:
        return names[0]
    return f"{names[0]} or one of the {len(names) - 1} alike in the other layers (the last: {names[-1]})"


def spec_named(name: str) -> DynamicSpec:
    return _specs[name]


class _ValueRecorder(FakeTensorProp):
    """Fake values into node.meta["val"], and every node's result into ``results``: some torch versions
    keep no "val" for a plain int (a size, or arithmetic on sizes)."""

    def __init__(self, module: torch.fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(module, mode)
        self.results: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.results[n] = super().run_node(n)
        return self.results[n]


def plan_static(spec: DynamicSpec, tensors: list[Any], sizes: list[int]
                ) -> tuple[torch.fx.GraphModule, Report, tuple[int, ...]]:
    """``spec.module`` at concrete sizes, its attention rewritten: the sizes put in the graph as constants
    and fake values of the inputs' layouts propagated through it (``tensors`` need only shape, stride(),
    dtype and device). Also the strides of the module's output before the rewrite."""
    static = torch.fx.GraphModule(spec.module, copy.deepcopy(spec.module.graph))
    fake_mode = FakeTensorMode()
    fakes = _fakes(tensors, spec.requires_grad, fake_mode)
    placeholders = [n for n in static.graph.nodes if n.op == "placeholder"]
    for node, known, t in zip(placeholders, spec.known, tensors):
        found = known.at_call(t) if known is not None else None
        if found is not None:
            node.meta[KNOWN] = found
    values = _ValueRecorder(static, fake_mode)
    (out,) = values.propagate(*fakes, *sizes)
    for node in list(static.graph.nodes):  # sizes (and arithmetic on them) become constants
        if node.op != "output" and not _holds_tensors(values.results[node]):
            value = values.results[node]
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
    static.graph.eliminate_dead_code()
    static.recompile()
    with torch.enable_grad():  # the op's backward runs with grad mode off; the marks must not follow it
        mark_requires_grad(static.graph, [*fakes, *sizes])
    report = Report(graph=spec.name)
    device = next((t.device for t in tensors), torch.device("cpu"))
    spec.static_rewrite(static, PassContext(report, spec.options, "forward", device, run_kernels=True,
                                            failures=spec.report, sizes_vary=True))
    with fake_mode:
        return static, report, tuple(torch.empty_like(out).stride())


def _holds_tensors(value: Any) -> bool:
    """A tensor, or a list of them (a split's parts): a value of the graph, not a size."""
    return isinstance(value, torch.Tensor) or isinstance(value, (list, tuple)) and any(map(_holds_tensors, value))


def _fakes(tensors: list[Any], requires_grad: list[bool], fake_mode: FakeTensorMode) -> list[torch.Tensor]:
    """Fake tensors laid out as `tensors` (shape, stride(), dtype and device are all read of them)."""
    with fake_mode:
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(needs)
                for t, needs in zip(tensors, requires_grad)]


def gradients_reach(module: torch.fx.GraphModule, tensors: list[Any], sizes: list[int], requires_grad: list[bool]
                    ) -> list[bool]:
    """Which of the tensor inputs that require a gradient the replaced ops pass one to, as eager's autograd finds
    it (on fake tensors): one read only through a comparison gets None from eager, which an optimizer skips, and
    the op's backward, whose structure its fake fixes at the compile, must give None there too, not zeros."""
    if not any(requires_grad):
        return requires_grad
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # the module's constants are real
    fakes = _fakes(tensors, requires_grad, fake_mode)
    with autograd_enabled(), fake_mode:  # (FakeTensorProp's results are detached)
        (out,) = module(*fakes, *sizes)
        if not out.requires_grad:
            return [False] * len(requires_grad)
        wanted = [x for x in fakes if x.requires_grad]
        reached = iter(torch.autograd.grad(out, wanted, torch.ones_like(out), allow_unused=True))
    return [needs and next(reached) is not None for needs in requires_grad]


def _external_inputs(graph: torch.fx.Graph, m: AttentionMatch
                     ) -> tuple[list[torch.fx.Node], list[torch.fx.Node], list[torch.fx.Node]]:
    """(the ops the attention's rewrite replaces, the tensors they read from outside, the numbers: sizes and
    other ints Dynamo made symbolic)."""
    sources = [walk_up(m.scores.left, through_scales=True)[0], walk_up(m.scores.right, through_scales=True)[0],
               walk_up(m.values.right)[0]]
    replaced = with_built_from_sizes(replaced_subgraph(graph, removed_nodes(m), sources))
    _, externals = subgraph_module(replaced, [], m.pv)
    tensors = [n for n in externals if isinstance(val(n), torch.Tensor)]
    return replaced, tensors, [n for n in externals if not isinstance(val(n), torch.Tensor)]


def reads_symbolic_ints(graph: torch.fx.Graph, m: AttentionMatch) -> bool:
    """Whether the attention reads an int Dynamo made symbolic (one that changed between calls: a window
    size from a closure): then it is planned at each value, as at each size."""
    return any(isinstance(val(n), torch.SymInt) for n in _external_inputs(graph, m)[2])


def rewrite_dynamic(graph: torch.fx.Graph, m: AttentionMatch, ctx: PassContext, name: str, where: str,
                    static_rewrite: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]
                    ) -> list[Rewrite]:
    """Cut the attention out as a module called through ``attention_dynamic``; its records at the sizes
    Dynamo saw. Raises ``Unsupported`` (the graph untouched) where that plan does not rewrite it.
    `static_rewrite` is the attention pass, which plans the module at each concrete size."""
    replaced, tensors, sizes = _external_inputs(graph, m)
    # A number read out of a tensor (a float argument Dynamo made symbolic arrives as a tensor and its item()) is
    # known only at run time, where sizes and what they compute are known at each plan.
    if any(getattr(n.target, "overloadpacket", None) in (aten.item, aten._local_scalar_dense) for n in replaced):
        raise Unsupported("the score chain reads a float Dynamo made symbolic (a number that changed between calls, "
                          "or specialize_float=False); torch.compile(..., dynamic=False) keeps it a constant")
    module, _ = subgraph_module(replaced, tensors + sizes, m.pv)
    examples, hints = [AtLengths(val(n)) for n in tensors], [hint(val(n)) for n in sizes]
    requires_grad = gradients_reach(module, examples, hints, [bool(n.meta.get("requires_grad")) for n in tensors])
    spec = DynamicSpec(name, module, requires_grad, ctx.options, static_rewrite, [known_input(n) for n in tensors],
                       location=where)
    bands = _held_bands(spec.known)
    form = _form(spec, ctx.report, DynamicSpec.key(examples, hints), bands)
    alike = _tables.get(form) if form is not None else None
    if alike is not None:  # its records at the sizes seen are those of the first attention alike
        records = [_as_member(r, alike, spec) for r in alike.compile_records]
    else:
        _, report, _ = plan_static(spec, examples, hints)
        records = [r for r in report.rewrites if r.kind == "attention"]
        if not records:
            reasons = [h.reason for h in report.hotspots if h.kind in ("attention", "fallback")]
            raise Unsupported(f"symbolic shapes, and at the sizes seen: {reasons[0] if reasons else 'not rewritten'}")
        for record in records:
            record.location = where
            record.detail["sizes"] = "symbolic: figures at the sizes first seen; planned again at each new size"
        if ctx.run_kernels:
            _compile_other_lengths_ahead(spec, [val(n) for n in tensors], [val(n) for n in sizes])
    spec.report = ctx.report  # set after the plan above, whose failures its own report records
    spec.records = [r for r in records if r.phase == "forward"]
    if form is not None:
        spec.join(form, records, bands)
    _specs[name] = spec
    hold(graph.owning_module, spec)
    if ctx.run_kernels:
        with graph.inserting_before(m.pv):
            call = graph.call_function(torch.ops.fusepass.attention_dynamic.default, (tensors, sizes, name))
            out = graph.call_function(operator.getitem, (call, 0))
            keep_location(call, m.softmax)
            keep_location(out, m.softmax)
        infer_meta([call, out])
        m.pv.replace_all_uses_with(out)
    else:  # the ops only it reads: a mask its module builds again stays the graph's for the other layers
        members = set(replaced)
        mark_planned([n for n in replaced if n is m.pv or all(u in members for u in n.users)], name)
    return records


def _compile_other_lengths_ahead(spec: DynamicSpec, tensors: list[torch.Tensor], sizes: list[Any]) -> None:
    """Plan the attention at lengths of the kinds the sizes seen are not (`other_lengths`): each plan's rewrite
    starts compiling its kernels. Only a warm-up, planned strict so that a failure raises and says nothing: it
    fails again, and is reported, at a call of such a length."""
    warm_up = replace(spec, options=replace(spec.options, strict=True))
    for lengths in other_lengths(tensors):
        try:
            plan_static(warm_up, [AtLengths(t, lengths) for t in tensors], [size_at(n, lengths) for n in sizes])
        except Exception:
            pass


def _token() -> torch.Tensor:
    return torch.empty(1, dtype=torch.int8)  # on the host: its address names the call, its value nothing


def _differentiated(s: DynamicSpec, plan: StaticPlan, tensors: list[torch.Tensor], sizes: list[int]
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the inputs, the output) of `plan` run under autograd, the inputs a gradient flows to requiring one."""
    with autograd_enabled():
        xs = [t.detach().requires_grad_(needs) for t, needs in zip(tensors, s.requires_grad)]
        return xs, plan.module(*xs, *sizes)[0]


def run_attention_dynamic(tensors: list[torch.Tensor], sizes: list[int], spec: str
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's output, and a token naming the call's forward for the backward."""
    s = _specs[spec]
    plan, token = s.static(tensors, sizes), _token()
    if plan.direct is not None:
        seed, outputs = plan.direct.forward(tensors)
        out = outputs[0]
        if any(s.requires_grad):
            keep_forward(token, (plan, (seed, outputs)))
    elif any(s.requires_grad):
        xs, out = _differentiated(s, plan, tensors, sizes)
        keep_forward(token, (plan, (xs, out)))
        out = out.detach()
    else:
        out = plan.module(*tensors, *sizes)[0]
    # As the fake lays it out (the replaced ops' output's, as empty_like lays it out: see `plan_static`); a copy,
    # since a custom op's output may not alias its inputs, nor what the backward will read.
    laid_out = with_strides(out, plan.out_strides)
    return (laid_out.clone() if laid_out is out else laid_out), token


# The ops' implementations are also called directly by the compiled graphs (fusepass/runnable.py).
attention_dynamic = torch.library.custom_op("fusepass::attention_dynamic", run_attention_dynamic, mutates_args=())


@attention_dynamic.register_fake
def _attention_dynamic_fake(tensors, sizes, spec):
    return torch.empty_like(_specs[spec].module(*tensors, *sizes)[0]), _token()


def run_attention_dynamic_backward(grad: torch.Tensor, tensors: list[torch.Tensor], token: torch.Tensor, spec: str
                                   ) -> list[torch.Tensor]:
    """Gradients of every tensor input (empty where none flows): the forward's kept outputs through the static
    op's backward (a direct plan), or its kept autograd graph differentiated (retained, for a second backward
    through one forward), its attention's backward the fused one."""
    s = _specs[spec]
    # The forward's own plan (one dropped since is held by what it kept).
    plan, state = kept_forward(token)
    if plan.direct is not None:
        grads = plan.direct.backward(grad, tensors, *state)
    else:
        xs, out = state
        with autograd_enabled():
            wanted = [x for x in xs if x.requires_grad]
            flowing = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True, retain_graph=True))
        grads = [next(flowing) if x.requires_grad else None for x in xs]
    result = []
    for x, g, needs in zip(tensors, grads, s.requires_grad):
        if not needs:
            result.append(x.new_empty(0))
        elif g is None:
            result.append(torch.zeros_like(x))
        else:  # as the fake lays it out
            result.append(with_strides(g.detach(), torch.empty_like(x, device="meta").stride()))
    return result


attention_dynamic_backward = torch.library.custom_op("fusepass::attention_dynamic_backward",
                                                    run_attention_dynamic_backward, mutates_args=())


@attention_dynamic_backward.register_fake
def _attention_dynamic_backward_fake(grad, tensors, token, spec):
    needs = _specs[spec].requires_grad
    return [torch.empty_like(t) if n else t.new_empty(0) for t, n in zip(tensors, needs)]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    tensors, sizes, spec = inputs
    ctx.save_for_backward(*tensors, output[1])
    ctx.sizes = sizes
    ctx.spec = spec


def _backward(ctx: Any, grad: torch.Tensor, _token_grad: Any):
    *tensors, token = ctx.saved_tensors
    grads = attention_dynamic_backward(grad.contiguous(), tensors, token, ctx.spec)
    # torch checks the gradients' structure against the inputs': a list of ints is one leaf, whose gradient is
    # None, but an empty list (no size read, as in unmasked attention) is a list, whose gradient is one too.
    return [g if needs else None for g, needs in zip(grads, _specs[ctx.spec].requires_grad)], \
        (None if ctx.sizes else []), None


attention_dynamic.register_autograd(_backward, setup_context=_setup_context)
