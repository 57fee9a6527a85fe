"""E, the differentiable graph: the pointwise ops through which gradients flow (from the scores, and from any tensor
that takes a gradient: a learnable bias table, a dense bias), over leaves that stand for the scores `s`, index values
and tensor elements. Its vector-Jacobian product is torch's own (`emit.vjp_graph`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fusepass.attention.lift.values import Code, Diff, GradLeaf

aten = torch.ops.aten
LANES = 4  # the fake length of E's values: pointwise ops do not care


class EGraph:
    def __init__(self, score_dtype: torch.dtype, tabulated: Callable[[Code], Code | None]) -> None:
        self.graph = torch.fx.Graph()
        self.fake = FakeTensorMode()
        self.leaves: dict[torch.fx.Node, Code | GradLeaf | None] = {}  # placeholder → what binds it
        self._leaf_of_expr: dict[str, torch.fx.Node] = {}
        # An index value that enters E may be read from a distance table instead (`tables.DistanceTables`).
        self._tabulated = tabulated
        self.s_leaf = self.placeholder("s", score_dtype, False)
        self.leaves[self.s_leaf] = None

    def placeholder(self, name: str, dtype: torch.dtype, zero_dim: bool) -> torch.fx.Node:
        node = self.graph.placeholder(f"{name}{len(self.leaves)}")
        with self.fake:
            node.meta["val"] = torch.empty(() if zero_dim else (LANES,), dtype=dtype)
        return node

    def grad_leaf(self, leaf: GradLeaf, dtype: torch.dtype, zero_dim: bool, uses: frozenset[str]) -> Diff:
        """A tensor element E reads whose gradient the backward accumulates."""
        node = self.placeholder("g", dtype, zero_dim)
        self.leaves[node] = leaf
        return Diff(node, uses)

    def leaf(self, code: Code) -> torch.fx.Node:
        """The placeholder an index value enters E as (one per expression)."""
        if code.expr not in self._leaf_of_expr:
            node = self.placeholder("v", code.dtype, code.zero_dim)
            self.leaves[node] = self._tabulated(code) or code
            self._leaf_of_expr[code.expr] = node
        return self._leaf_of_expr[code.expr]

    def node(self, target: Any, args: tuple, kwargs: dict, uses: frozenset[str] | None = None) -> Diff:
        """``target(*args, **kwargs)`` as a node of E; index values among the arguments become leaves."""
        def as_e(a: Any) -> Any:
            if isinstance(a, Diff):
                return a.node
            if isinstance(a, Code):
                return self.leaf(a)
            if isinstance(a, (list, tuple)):
                return type(a)(as_e(x) for x in a)
            return a

        def as_float(a: Any) -> Any:
            if isinstance(a, Code) and a.as_float is not None:
                return Code(a.as_float, torch.float32, a.uses, a.zero_dim)
            if isinstance(a, (list, tuple)):
                return type(a)(as_float(x) for x in a)
            return a

        def fake(e_args: Any) -> Any:
            return torch.fx.node.map_arg(e_args, lambda n: n.meta["val"])

        def fake_value(a: Any) -> Any:  # without making leaves of index values
            if isinstance(a, Diff):
                return a.node.meta["val"]
            if isinstance(a, Code):
                return torch.empty(() if a.zero_dim else (LANES,), dtype=a.dtype)
            if isinstance(a, (list, tuple)):
                return type(a)(fake_value(x) for x in a)
            return a

        with self.fake:
            result = target(*fake_value(args), **{k: fake_value(v) for k, v in kwargs.items()})
        if result.dtype == torch.float32:
            # An integer promoted to fp32 by the op: its exact fp32 form (converted per position vector, not
            # per score) stands for it.
            args, kwargs = as_float(args), {k: as_float(v) for k, v in kwargs.items()}
        e_args, e_kwargs = as_e(args), {k: as_e(v) for k, v in kwargs.items()}
        node = self.graph.call_function(target, e_args, e_kwargs)
        with self.fake:
            node.meta["val"] = target(*fake(e_args), **fake(e_kwargs))
        if uses is None:
            uses = frozenset().union(*[a.uses for a in list(args) + list(kwargs.values())
                                       if isinstance(a, (Code, Diff))])
        return Diff(node, uses)

    def module(self, replace: dict | None = None) -> torch.fx.GraphModule:
        """E as a module, with a node replaced by another node or by ``("constant", v)`` or
        ``("add", node, v)``."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {}
        replace = replace or {}
        for node in self.graph.nodes:
            if node in replace:
                how = replace[node]
                if isinstance(how, torch.fx.Node):
                    env[node] = env[how]
                elif how[0] == "constant":
                    env[node] = graph.call_function(aten.full_like.default, (env[self.s_leaf], how[1]),
                                                    {"dtype": node.meta["val"].dtype})
                    env[node].meta["val"] = node.meta["val"]
                else:
                    env[node] = graph.call_function(aten.add.Tensor, (env[how[1]], how[2]))
                    env[node].meta["val"] = node.meta["val"]
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.eliminate_dead_code()
        module = torch.fx.GraphModule({}, graph)
        module.meta["leaves"] = [n.name for n in graph.nodes if n.op == "placeholder"]
        return module