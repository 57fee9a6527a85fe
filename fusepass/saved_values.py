"""What the forward keeps for the backward: AOTAutograd's min-cut partition, on a joint graph without detaches.

The joint graph holds an ``aten.detach`` wherever autograd saved a result for its backward formula (``exp``'s
output, ``amax``'s). The min-cut partitioner does not see through them: it then keeps the detached value, often a
full fp32 tensor (a log-softmax's exponentials), where recomputing it in the backward from a bf16 input costs
nothing but reading that input again. Inductor decomposes ``detach`` away before partitioning; so does this, for
every detach whose value is not itself a graph output (an output keeps its aliasing as traced). A pass may
write ops out before the cut (`partition_with`): the softmaxes, whose outputs the cut would otherwise keep.
"""
from __future__ import annotations

from collections.abc import Callable
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


Partition = Callable[..., tuple[torch.fx.GraphModule, torch.fx.GraphModule]]


def partition_with(write_out: Callable[[torch.fx.GraphModule], None] | None) -> Partition:
    """AOTAutograd's `partition_fn`: the joint graph's detaches dropped, `write_out` run on it, then min-cut."""

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
                  ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        drop_detaches(joint)
        if write_out is not None:
            write_out(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    return partition
