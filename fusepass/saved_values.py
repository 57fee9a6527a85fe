"""What the forward keeps for the backward: AOTAutograd's min-cut partition, on a joint graph without detaches.

The joint graph holds an ``aten.detach`` wherever autograd saved a result for its backward formula (``exp``'s
output, ``amax``'s). The min-cut partitioner does not see through them: it then keeps the detached value, often a
full fp32 tensor (a log-softmax's exponentials), where recomputing it in the backward from a bf16 input costs
nothing but reading that input again. Inductor decomposes ``detach`` away before partitioning; so does this, for
every detach whose value is not itself a graph output (an output keeps its aliasing as traced).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from functorch.compile import min_cut_rematerialization_partition


def drop_detaches(joint: torch.fx.GraphModule) -> None:
    graph = joint.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default and \
                all(user.op != "output" for user in node.users):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    joint.recompile()


def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[torch.fx.GraphModule,
                                                                                      torch.fx.GraphModule]:
    drop_detaches(joint)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
