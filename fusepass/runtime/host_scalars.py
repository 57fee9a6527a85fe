"""Scalars a device graph makes on the host, made on the device instead, so that the graph can be replayed whole.

A CUDA graph holds no CPU tensor (`whole_graphs.refusal`), and models make a few: Gemma's normalizer
``torch.tensor(width ** 0.5, dtype=...)`` is a tensor constant of the traced graph, and the backward of
``torch.where(c, x, 0.0)`` builds its zero with ``aten.scalar_tensor(..., device=cpu)``. Where such a 0-d
tensor reaches only ops whose result lies on the device, made there it computes the same: a 0-d operand takes
part in type promotion and broadcasting alike on either device. The reach is torch's own rule, Inductor's
`ConstructorMoverPass` (its ``allow_inputs`` form: an op on the device whose inputs are on the device or 0-d on
the host may take them on the device); a value that reaches an op that needs it on the host (an ``.item()``, an
output of the graph, an op outside ATen) keeps it there.

Graph inputs stay where the caller puts them: a constant is the graph's own, an input is the caller's."""
from __future__ import annotations

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import _is_tensor_constructor

from fusepass.context import PassContext
from fusepass.fx_util import infer_meta


def host_scalars_made_on_device(module: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """The pipeline's step: `made_on_device` on the graph's device."""
    made_on_device(module, ctx.device)
    return module


def made_on_device(module: torch.fx.GraphModule, device: torch.device) -> list[str]:
    """Move `module`'s host scalars (constructors and 0-d tensor constants on the CPU) to `device` where every op
    they reach lies there; the moved nodes' names."""
    from torch._inductor.fx_passes.post_grad import ConstructorMoverPass

    graph = module.graph
    roots = [node for node in graph.nodes if _host_constant(module, node) or _host_constructor(node)]
    if not roots:
        return []
    mover = ConstructorMoverPass(device.type, allow_inputs=True)
    reach_the_device = mover.find_movable_constructors(graph, roots)
    movable = [node for node in roots if node in reach_the_device and not _needed_on_host(node)]
    fake_mode = detect_fake_mode([node.meta.get("val") for node in graph.nodes])
    for node in movable:
        if node.op == "get_attr":
            value = getattr(module, node.target).to(device)
            setattr(module, node.target, value)
            node.meta["val"] = fake_mode.from_tensor(value)
        else:
            node.kwargs = {**node.kwargs, "device": device}
            infer_meta([node], fake_mode)
    # What the moved values reached on the host before reaching the device (``lift_fresh_copy``, a cast) now runs
    # on the device: its values are inferred again, in graph order.
    moved = set(movable)
    for node in graph.nodes:
        if node.op == "call_function" and node not in moved and any(a in moved for a in node.all_input_nodes) \
                and _on_host(node):
            infer_meta([node], fake_mode)
            moved.add(node)
    if movable:
        module.recompile()
    return [node.name for node in movable]


def _needed_on_host(root: torch.fx.Node) -> bool:
    """Whether `root`'s value, through the ops on the host it reaches, is an output of the graph or is read by an op
    outside ATen or one whose result is no tensor (an ``.item()``). The mover's rule says so too, but not in every
    torch release (2.11's moves a constant that reaches an output): the graph's outputs lie where eager puts them."""
    seen, stack = {root}, [root]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload) \
                    or not isinstance(user.meta.get("val"), torch.Tensor):
                return True
            if _on_host(user):
                stack.append(user)
    return False


def _on_host(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def _host_constant(module: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A 0-d CPU tensor the graph holds (a traced ``torch.tensor(x)``), with its fake value."""
    if node.op != "get_attr" or not _on_host(node):
        return False
    value = getattr(module, node.target, None)
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _host_constructor(node: torch.fx.Node) -> bool:
    """An ATen constructor on the CPU of a 0-d tensor (``scalar_tensor``, ``full([], ...)``)."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and _is_tensor_constructor(node.target) and _on_host(node) and node.meta["val"].dim() == 0 \
        and torch.Tag.nondeterministic_seeded not in node.target.tags
