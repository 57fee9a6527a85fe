"""Which pointwise nodes of a graph run together as one kernel.

Producer and consumer merge greedily, in graph order, the pairs refused again until none merge; then groups
reading a common tensor (siblings, such as the two gradients of SwiGLU's backward) merge, so that the tensor is
read once. Both while three rules hold:
- no cycle: no path leaves the merged group and comes back into it (checked with networkx on the
  graph of groups; siblings merge only where no path joins them);
- one iteration space: every value the group writes out has one shape (values read only inside the
  group may be smaller and are broadcast); a group holding row reductions or column sums (``reduction``)
  iterates over their input's shape, one shape for all of them, and writes values of that shape or of its
  rows', and its column sums, read outside it only;
- views inside a group are affine in the group's coordinates (see ``coords``); views at its edges stay in
  the graph, where they cost nothing;
- a cat or slice_backward (``pieces``) joins groups without row reductions or column sums.
A group is a kernel where it computes two ops or more, a column sum alone (`LONE_COLUMN_SUMS`), or an op alone whose
value a padded matmul reads (its kernel writes it padded: `matmul/pads_in_producers.py`).
Nodes a pointwise chain would need but the translator cannot emit are reported, not merged.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx

from fusepass.codegen.operands import SUPPORTED_DTYPES

from fusepass.codegen.translate import CONSTANTS, constant_value, packet_of, translation_gap
from fusepass.context import planned_attention
from fusepass.elementwise.coords import identity, is_mapped_view, through_view
from fusepass.elementwise.pieces import is_piecewise, piece_gap
from fusepass.elementwise.reduction import column_sum_of, is_column_sum, is_reduction, reduced_input
from fusepass.matmul.pad import read_padded_alone


# A column sum with no pointwise op beside it (a bias's gradient alone) runs as a row kernel of its own rather than
# as ATen's sum, which the GPU timed slower (bench/column_sums.py, its "ATen's lone sums" column; bench/NOTES.md).
LONE_COLUMN_SUMS = True


@dataclass
class Group:
    nodes: list[torch.fx.Node]  # graph order: pointwise ops and the views between them
    outputs: list[torch.fx.Node] = field(default_factory=list)  # members whose values are written out
    kept_views: set[torch.fx.Node] = field(default_factory=set)  # members also used outside: stay

    @property
    def compute_nodes(self) -> list[torch.fx.Node]:
        return [n for n in self.nodes if not is_mapped_view(n)]

    @property
    def inputs(self) -> list[torch.fx.Node]:
        """External tensors the group reads, first use first (read off the graph as it is now: a group
        replaced before this one may have rewired them)."""
        members = set(self.nodes)
        inputs: list[torch.fx.Node] = []
        for node in self.nodes:
            for arg in _tensor_args(node):
                if arg not in members and arg not in inputs and not is_constant(arg):
                    inputs.append(arg)
        return inputs


@dataclass
class Declined:
    node: torch.fx.Node
    reason: str


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if _val(a) is not None]


def decline_reason(node: torch.fx.Node, device: torch.device) -> str | None:
    """Why ``node`` cannot be part of a fused group, or None if it can."""
    val = _val(node)
    if val is None:
        return "produces no tensor"
    if planned_attention(node):
        return "inside a planned attention rewrite"
    if val.dtype not in SUPPORTED_DTYPES:
        return f"dtype {val.dtype} has no Triton translation"
    if val.device != device:
        return f"runs on {val.device}"
    if any(isinstance(a, torch.fx.Node) and _val(a) is None for a in node.all_input_nodes):
        return "reads a symbolic scalar"
    if is_mapped_view(node):
        rank = val.dim()
        return None if through_view(node, identity(rank), rank) is not None else "view is not affine"
    if is_piecewise(node):
        gap = piece_gap(node)
    else:
        gap = None if is_reduction(node) else translation_gap(node.target, node.args, node.kwargs)
    if gap is not None:
        return gap
    if is_constant(node):
        return "a constant: inlined into each group that reads it"
    for arg in _tensor_args(node):
        arg_val = _val(arg)
        if arg_val.dtype not in SUPPORTED_DTYPES:
            return f"input dtype {arg_val.dtype} has no Triton translation"
        if arg_val.device != device and arg_val.dim() != 0:
            return f"input on {arg_val.device}"
    return None


def _host_scalar(node: torch.fx.Node, device: torch.device) -> bool:
    """A 0-d tensor computed on the host for a graph on a device (Gemma's ``torch.tensor(sqrt(width))``
    normalizer): no memory traffic to fuse, and kernels take it by value."""
    val = _val(node)
    return val is not None and val.dim() == 0 and val.device.type == "cpu" and device.type != "cpu"


def is_constant(node: torch.fx.Node) -> bool:
    """A constant fill (``full``, ``zeros``, …): each group that reads it computes it in place."""
    val = _val(node)
    if node.op != "call_function" or packet_of(node.target) not in CONSTANTS or val is None:
        return False
    value = constant_value(packet_of(node.target), node.args, node.kwargs)
    # A fill that is a graph value (a symbolic scalar) is not known when the kernel is written.
    return all(isinstance(s, int) for s in val.shape) and isinstance(value, (bool, int, float))


def is_pointwise(node: torch.fx.Node) -> bool:
    """What torch itself tags pointwise: a translator miss on one of these is a missed fusion."""
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.pointwise in tags


class _Groups:
    """Union-find over nodes, mirrored in a networkx graph whose vertices are the groups."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.leader = {n: n for n in graph.nodes}
        self.members = {n: [n] for n in graph.nodes}
        self.dag = nx.DiGraph()
        self.dag.add_nodes_from(graph.nodes)
        self.dag.add_edges_from((a, n) for n in graph.nodes for a in n.all_input_nodes)

    def find(self, node: torch.fx.Node) -> torch.fx.Node:
        while self.leader[node] is not node:
            self.leader[node] = self.leader[self.leader[node]]
            node = self.leader[node]
        return node

    def creates_cycle(self, producer: torch.fx.Node, consumer: torch.fx.Node) -> bool:
        return any(s is not consumer and nx.has_path(self.dag, s, consumer)
                   for s in self.dag.successors(producer))

    def joined(self, a: torch.fx.Node, b: torch.fx.Node) -> bool:
        """Whether a path joins the groups led by `a` and `b`, either way."""
        return nx.has_path(self.dag, a, b) or nx.has_path(self.dag, b, a)

    def merge(self, producer: torch.fx.Node, consumer: torch.fx.Node) -> None:
        nx.contracted_nodes(self.dag, consumer, producer, self_loops=False, copy=False)
        self.leader[producer] = consumer
        self.members[consumer] += self.members.pop(producer)


def _storage(node: torch.fx.Node, members: set[torch.fx.Node]) -> torch.fx.Node:
    """The member whose memory a value lives in: views resolve to what they view."""
    while is_mapped_view(node) and node.args[0] in members:
        node = node.args[0]
    return node


def _escaping(members: set[torch.fx.Node]) -> list[torch.fx.Node]:
    return [n for n in members if any(u not in members for u in n.users)]


def _shape_key(shape: Sequence) -> tuple[str, ...]:
    return tuple(map(str, shape))  # symbolic sizes by their expressions (SymInts do not hash)


def root_shape(members: Iterable[torch.fx.Node]) -> tuple | None:
    """The shape a group holding row reductions or column sums iterates over (their input's), or None."""
    for node in members:
        if is_reduction(node):
            return tuple(_val(reduced_input(node)).shape)
    return None


def _one_iteration_space(members: set[torch.fx.Node]) -> bool:
    root = root_shape(members)
    if root is None:
        return len({_shape_key(_val(_storage(n, members)).shape) for n in _escaping(members)}) <= 1
    if any(is_piecewise(n) for n in members):  # the row kernels read no guards
        return False
    if any(_shape_key(_val(reduced_input(n)).shape) != _shape_key(root) for n in members if is_reduction(n)):
        return False
    # A column sum is whole only once every program has added its rows: read outside the group alone (but for
    # its rounding, which the launcher applies).
    if any(u in members and column_sum_of(u, members) is not n for n in members if is_column_sum(n) for u in n.users):
        return False
    rows = {_shape_key(root), _shape_key(root[:-1] + (1,)), _shape_key(root[:-1])}
    return all(_shape_key(_val(_storage(n, members)).shape) in rows for n in _escaping(members)
               if column_sum_of(n, members) is None)


def partition(graph: torch.fx.Graph, device: torch.device, apart: frozenset[torch.fx.Node] = frozenset()
              ) -> tuple[list[Group], list[Declined]]:
    """The groups, and the pointwise ops that cannot join one; `apart`: row reductions left out of groups (their
    group could not be lowered, ``fuse``)."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    reasons = {n: decline_reason(n, device) for n in nodes if n.op == "call_function"}
    fusable = {n for n, reason in reasons.items() if reason is None and n not in apart}
    declined = [Declined(n, reasons[n]) for n in nodes
                if (is_pointwise(n) or is_piecewise(n)) and reasons.get(n) is not None and not is_constant(n)
                and not planned_attention(n) and not _host_scalar(n, device)]

    groups = _Groups(graph)
    # The pairs refused are tried again while any pair merged: a producer whose value escapes to readers not yet
    # grouped (a view read by a row's maximum and by the row's other ops) can join their group once they are one.
    pending = [(arg, node) for node in nodes if node in fusable for arg in node.all_input_nodes if arg in fusable]
    while pending:
        refused, merged = [], False
        for arg, node in pending:
            producer, consumer = groups.find(arg), groups.find(node)
            if producer is consumer:
                continue
            union = set(groups.members[producer]) | set(groups.members[consumer])
            if not _one_iteration_space(union) or groups.creates_cycle(producer, consumer):
                refused.append((arg, node))
                continue
            groups.merge(producer, consumer)
            merged = True
        pending = refused if merged else []
    for node in nodes:
        readers = [u for u in node.users if u in fusable]
        for first, other in zip(readers, readers[1:]):
            a, b = groups.find(first), groups.find(other)
            if a is b:
                continue
            if not _one_iteration_space(set(groups.members[a]) | set(groups.members[b])) or groups.joined(a, b):
                continue
            groups.merge(a, b)

    result = []
    for leader, members in groups.members.items():
        if not fusable.issuperset(members):  # a node no rule fuses stays a group of its own: not a kernel
            continue
        group = _finish(set(members), order)
        if group is not None:
            result.append(group)
    result.sort(key=lambda g: order[g.nodes[0]])
    return result, declined


def _finish(members: set[torch.fx.Node], order: dict[torch.fx.Node, int]) -> Group | None:
    """Trim views at the group's edges, then name its inputs and outputs; None if nothing to fuse."""
    changed = True
    while changed:
        changed = False
        for node in list(members):
            if is_mapped_view(node) and (node.args[0] not in members or all(u not in members for u in node.users)):
                members.discard(node)
                changed = True
    nodes = sorted(members, key=order.__getitem__)
    computed = [n for n in nodes if not is_mapped_view(n)]
    # A lone op is a kernel where a padded matmul reads its value alone: the kernel writes it padded, the copy goes.
    if len(computed) < 2 and not (computed and ((LONE_COLUMN_SUMS and is_column_sum(computed[0]))
                                                or read_padded_alone(computed[0]))):
        return None
    escaping = _escaping(members)
    kept_views = set()
    for node in escaping:
        while is_mapped_view(node) and node in members:
            kept_views.add(node)
            node = node.args[0]
    outputs = sorted({_storage(n, members) for n in escaping}, key=order.__getitem__)
    return Group(nodes=nodes, outputs=outputs, kept_views=kept_views)
