"""Dynamo's torch-level graph → a functional ATen graph, traced before autograd.

Every pass then reads one op vocabulary (``aten.matmul``, ``aten.softmax.int``, ``aten.to.dtype``, …) that
still looks like the user's code, with the user's source line in each node's ``meta["stack_trace"]``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch._dynamo.source import ConstantSource
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.attention.known_contents import mark_known
from fusepass.fx_util import infer_meta

NO_GRADIENT = {torch.ops.aten.detach.default}  # ops whose float output no gradient passes through


def fake_mode_of(example_inputs: Sequence[object]) -> FakeTensorMode:
    return detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)


def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> torch.fx.GraphModule:
    fake_mode = fake_mode_of(example_inputs)
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode, torch.fx.traceback.preserve_node_meta():
        traced = make_fx(torch.fx.Interpreter(gm).run, pre_dispatch=True)(*fake_inputs)
    if functional_pointwise(traced.graph):
        traced.recompile()
    mark_requires_grad(traced.graph, example_inputs)
    mark_known(traced.graph, example_inputs, [input_name(n) for n in gm.graph.nodes if n.op == "placeholder"])
    return traced


def input_name(placeholder: torch.fx.Node) -> str:
    """The user's name of a Dynamo graph's input (``L['self'].bias``), where Dynamo kept its source."""
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    if source is None:
        return placeholder.name
    name = source.name  # a method on some torch versions, a property on others
    return name() if callable(name) else name


def _returns_alias(node: torch.fx.Node) -> bool:
    """Whether the node's value may share storage with another's: a view, an op that may return its input
    (``contiguous``, ``to``), an item of a list of views (``split``), a graph input."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in node.target._schema.returns)


def _owns_its_storage(node: torch.fx.Node) -> bool:
    """Whether no other value of the graph can read the node's memory: an op's fresh result, or views of one (the
    scores' ``bmm(...).view(...)``) that nothing else reads."""
    while _returns_alias(node):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node) or \
                len(node.args[0].users) != 1:
            return False
        node = node.args[0]
    return True


def functional_pointwise(graph: torch.fx.Graph) -> bool:
    """In-place pointwise ops (``s *= scale``, ``s.masked_fill_(...)``) on a tensor whose memory nothing else reads
    become their functional twins, so that the passes see the chain as written without its mutations; returns whether any
    did. The rewrite is exact: no other tensor shares the storage, the result is cast back to the mutated
    tensor's dtype as the in-place op stores it, and every later read of the tensor reads the new value."""
    from fusepass.codegen.translate import is_supported

    order = {node: i for i, node in enumerate(graph.nodes)}
    changed = False
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                not target._schema.name.endswith("_") or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        base = node.args[0]
        functional = getattr(getattr(torch.ops.aten, target._schema.name.split("::")[1][:-1], None),
                             target._overloadname, None)
        if functional is None or not is_supported(functional, node.args, node.kwargs) or not _owns_its_storage(base) or \
                any(_returns_alias(user) and order[user] < order[node] for user in base.users if user is not node):
            continue
        with graph.inserting_before(node):
            result = graph.call_function(functional, node.args, node.kwargs)
            result.meta.update(node.meta)
            infer_meta([result])
            if result.meta["val"].dtype != base.meta["val"].dtype:
                cast = graph.call_function(torch.ops.aten._to_copy.default, (result,),
                                           {"dtype": base.meta["val"].dtype})
                cast.meta.update(node.meta)
                infer_meta([cast])
                result = cast
        for user in list(base.users):
            if order.get(user, -1) > order[node]:
                user.replace_input_with(base, result)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        changed = True
    return changed


def carries_gradient(val: object) -> bool:
    """Whether a value can carry a gradient: a floating (or complex) tensor, or a list or tuple holding one
    (``split``, ``chunk``, ``unbind``). A value of unknown kind is taken to carry one: a gradient missed is
    a wrong result, one assumed where none flows only costs work."""
    if isinstance(val, torch.Tensor):
        return val.is_floating_point() or val.is_complex()
    if isinstance(val, (list, tuple)):
        return any(carries_gradient(v) for v in val)
    return val is None


def mark_requires_grad(graph: torch.fx.Graph, example_inputs: Sequence[object]) -> None:
    """``node.meta["requires_grad"]``: whether a gradient will flow to the node's value (the fake values
    of a graph traced before autograd do not say)."""
    inputs = iter(example_inputs)
    grad_mode = torch.is_grad_enabled()  # Dynamo compiles under the caller's grad mode
    for node in graph.nodes:
        if node.op == "placeholder":
            x = next(inputs, None)
            node.meta["requires_grad"] = grad_mode and bool(getattr(x, "requires_grad", False))
        elif node.op == "call_function":
            differentiable = node.target not in NO_GRADIENT and carries_gradient(node.meta.get("val"))
            node.meta["requires_grad"] = differentiable and any(
                a.meta.get("requires_grad", False) for a in node.all_input_nodes)


def carry_input_sources(dynamo: torch.fx.GraphModule, rewritten: torch.fx.GraphModule) -> bool:
    """Give `rewritten` (traced from Dynamo's graph `dynamo`, then rewritten; the same inputs in the same order)
    what AOTAutograd reads off a Dynamo graph to tell which of its inputs are parameters and buffers: their
    sources and Dynamo's static marks. From them it takes its `static_input_indices`, which CUDA graph trees leave
    where they are: without them each whole-graph replay would copy every parameter into the recording's buffers
    first (and the pool would hold a second copy of them). Nothing is carried where the inputs do not match one to
    one, or where `dynamo` carries no sources itself (not Dynamo's graph): False. A tensor the trace baked into
    `rewritten` (``torch.tensor(width ** 0.5)`` in the user's code, a ``_tensor_constant`` buffer that Dynamo's
    graph makes in a call) has no source of Dynamo's: it gets a constant source of its own name, which AOTAutograd
    needs only to tell its lifted inputs apart, and counts as static like a buffer (it is one, and never changes)."""
    if "dynamo_compile_id" not in dynamo.meta or not hasattr(dynamo, "_param_name_to_source"):
        return False
    theirs = dynamo.graph.find_nodes(op="placeholder")
    ours = rewritten.graph.find_nodes(op="placeholder")
    sources = dict(dynamo._param_name_to_source)
    sources.update({name: ConstantSource(f"fusepass_{name}") for name in _baked_constants(dynamo, rewritten)
                    if name not in sources})
    held = [name for name, _ in rewritten.named_parameters(remove_duplicate=False)] + \
        [name for name, _ in rewritten.named_buffers(remove_duplicate=False)]
    if len(theirs) != len(ours) or any(not hasattr(n, "_dynamo_source") for n in theirs) or \
            any(name not in sources for name in held):
        return False
    for node, source in zip(ours, theirs):
        node._dynamo_source = source._dynamo_source
        if "tensor_dict" in source.meta:
            node.meta["tensor_dict"] = source.meta["tensor_dict"]
    rewritten._param_name_to_source = {name: sources[name] for name in held}
    rewritten.meta["dynamo_compile_id"] = dynamo.meta["dynamo_compile_id"]
    return True


def _baked_constants(dynamo: torch.fx.GraphModule, rewritten: torch.fx.GraphModule) -> set[str]:
    """The buffers of `rewritten` that its graph reads by name and Dynamo's module does not hold: the tensors
    `make_fx` baked in."""
    theirs = {name for name, _ in dynamo.named_buffers(remove_duplicate=False)} | \
        {name for name, _ in dynamo.named_parameters(remove_duplicate=False)}
    buffers = dict(rewritten.named_buffers(remove_duplicate=False))
    return {node.target for node in rewritten.graph.find_nodes(op="get_attr")
            if node.target in buffers and node.target not in theirs}
