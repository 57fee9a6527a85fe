"""A size's plan that is the static attention op on the dynamic op's own tensors, run without autograd.

Most attentions planned at a concrete size (attention/dynamic.py) come out as one `fusepass::attention` call on
the tensors the dynamic op was given: the op reads the sources of Q, K and V, not their views. Such a plan runs
the op's implementation directly, and its backward the backward op's with the forward's outputs, where
running the plan's graph under autograd would pass each call through the dispatcher, the custom op's autograd
layer and autograd's engine: host time on every forward and backward of every layer. A plan with other ops
around the attention (a cast, a view the op could not read through) is differentiated through autograd.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from fusepass.attention.call import Outputs
from fusepass.attention.op import run_attention, run_attention_backward


@dataclass(frozen=True)
class DirectPlan:
    q: int  # which of the dynamic op's tensors each operand of the static op is
    k: int
    v: int
    aux: tuple[int, ...]
    seed: torch.fx.Node  # the seed tensor's creation, from constants alone
    spec: str  # the static op's

    def forward(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, Outputs]:
        """(the seed, the static op's outputs: the attention's output first)."""
        seed = self.seed.target(*self.seed.args, **self.seed.kwargs)
        return seed, run_attention(tensors[self.q], tensors[self.k], tensors[self.v],
                                   [tensors[i] for i in self.aux], seed, self.spec)

    def backward(self, grad: torch.Tensor, tensors: list[torch.Tensor], seed: torch.Tensor, outputs: Outputs
                 ) -> list[torch.Tensor | None]:
        """The gradient of each of the dynamic op's tensors (None where none flows), a tensor read twice (one
        source of Q and K) summed."""
        out, lse, log_sum, fallback, residual, block_map = outputs  # the map the forward returned is its backward's
        aux = [tensors[i] for i in self.aux]
        dq, dk, dv, daux = run_attention_backward(grad, tensors[self.q], tensors[self.k], tensors[self.v], out, lse,
                                                  log_sum, fallback, residual, list(block_map), aux, seed, self.spec)
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        flowing = [(i, g) for i, g in zip((self.q, self.k, self.v, *self.aux), (dq, dk, dv, *daux)) if g.numel()]
        for i, g in flowing:  # empty: an aux gradient none needs, or a gradient another's buffer holds
            grads[i] = g if grads[i] is None else grads[i] + g
        return grads


def direct_plan(static: torch.fx.GraphModule) -> DirectPlan | None:
    """`static`'s direct form, where it is the static op on its tensor inputs alone (their sizes after them)."""
    graph = static.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    calls = [n for n in graph.nodes if n.target is torch.ops.fusepass.attention.default]
    if len(calls) != 1:
        return None
    (call,) = calls
    results = graph.output_node().args[0]
    if not (isinstance(results, (tuple, list)) and len(results) == 1 and results[0].target is operator.getitem
            and results[0].args == (call, 0)):
        return None
    q, k, v, aux, seed, spec = call.args
    if not all(isinstance(a, torch.fx.Node) and a in placeholders for a in (q, k, v, *aux)):
        return None
    rest = [n for n in graph.nodes if n.op != "placeholder" and n not in (call, results[0], seed)
            and n.op != "output"]
    if rest or not isinstance(seed, torch.fx.Node) or seed.all_input_nodes or seed.op != "call_function":
        return None
    index = placeholders.index
    return DirectPlan(index(q), index(k), index(v), tuple(index(a) for a in aux), seed, spec)

