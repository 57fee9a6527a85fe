"""Host scalars made on the graph's device (runtime/host_scalars.py), so that whole-graph replays may hold the graph:
which move (a 0-d constant or constructor whose every reach lies on the device), which stay (an output, a host
op on the way, the caller's input), and that the values the passes read follow. The graphs are traced over fake
tensors on the `meta` device where a constant's own tensor must move (this machine has no CUDA device), on fake
CUDA tensors where only a constructor's argument changes. The replays themselves: test_whole_graphs_cuda.py
(Gemma 2's normalizer)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.runtime.host_scalars import made_on_device
from fusepass.runtime.whole_graphs import refusal


def _traced(fn, device: str, *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [torch.empty(shape, device=device) for shape in shapes]
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _devices(graph: torch.fx.GraphModule) -> dict[str, str]:
    return {n.name: n.meta["val"].device.type for n in graph.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}


def normalized_and_clamped(x):
    normalizer = torch.tensor(7 ** 0.5, dtype=x.dtype)  # Gemma's, traced as a constant of the graph
    h = x * normalizer.to(torch.float32)
    return (torch.where(h > 0, h, torch.scalar_tensor(0.0)),)


def test_a_constant_and_a_constructor_that_reach_only_the_device_are_made_there():
    graph = _traced(normalized_and_clamped, "meta", (4, 5))
    assert "cpu" in _devices(graph).values()
    moved = made_on_device(graph, torch.device("meta"))
    assert sorted(moved) == ["_tensor_constant0", "scalar_tensor"]
    assert set(_devices(graph).values()) == {"meta"}  # the cast on the way moved with its constant
    assert getattr(graph, "_tensor_constant0").device.type == "meta"
    assert graph.graph.find_nodes(op="call_function", target=torch.ops.aten.scalar_tensor.default)[0] \
        .kwargs["device"] == torch.device("meta")


def test_a_constructor_made_on_the_device_lets_the_graph_be_replayed():
    graph = _traced(lambda x: (torch.where(x > 0, x, torch.scalar_tensor(0.0)),), "cuda", (4, 5))
    assert refusal(graph, static=[]) == "scalar_tensor is a tensor on the CPU, which a CUDA graph does not hold"
    assert made_on_device(graph, torch.device("cuda", 0)) == ["scalar_tensor"]
    assert refusal(graph, static=[]) is None


def test_what_the_host_still_needs_stays_there():
    def kept_on_host(x, host_scale):
        returned = torch.tensor(3.0)  # an output: the caller gets it where eager gives it
        summed = torch.ones(3).sum()  # not 0-d where made: the CPU sum on its way is not moved
        return x * host_scale, returned, x * summed

    graph = _traced(kept_on_host, "meta", (4,), ())
    placeholder = graph.graph.find_nodes(op="placeholder")[1]
    placeholder.meta["val"] = placeholder.meta["val"].to("cpu")  # the caller's 0-d input, on the host
    assert made_on_device(graph, torch.device("meta")) == []
    assert _devices(graph)[placeholder.name] == "cpu"


def test_a_constant_read_by_a_host_op_and_the_device_stays_with_both():
    def read_twice(x):
        scale = torch.tensor(2.0)
        return x * scale, scale + 1  # the second is a CPU output

    graph = _traced(read_twice, "meta", (4,))
    assert made_on_device(graph, torch.device("meta")) == []
    assert getattr(graph, "_tensor_constant0").device.type == "cpu"
