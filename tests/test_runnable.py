"""`on_device`: a compiled graph runs with its tensors' CUDA device current (Triton launches on the current
device); checked with the CUDA device calls recorded, so it runs on any machine."""
import contextlib

import torch
import torch.fx

from fusepass.runnable import BINDINGS, on_device, runnable


def _recorded(monkeypatch, current: int) -> list:
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device", device)
    return entered


def test_a_graph_on_another_device_runs_with_it_current(monkeypatch):
    entered = _recorded(monkeypatch, current=0)
    assert on_device(lambda x: x + 1, torch.device("cuda", 1))(1) == 2
    assert entered == [1]


def test_a_graph_on_the_current_device_or_the_cpu_changes_nothing(monkeypatch):
    entered = _recorded(monkeypatch, current=1)
    assert on_device(lambda x: x + 1, torch.device("cuda", 1))(1) == 2
    fn = lambda x: x  # noqa: E731
    assert on_device(fn, torch.device("cpu")) is fn
    assert entered == []


def _binding_cases():
    """(overload, args, kwargs) for each of `BINDINGS`, as a graph's node holds them."""
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    x, m = r(3, 5, 7), r(5, 7)
    return [
        (aten.view.default, (x, [15, 7]), {}),
        (aten.t.default, (m,), {}),
        (aten.transpose.int, (x, 0, 2), {}),
        (aten.permute.default, (x, [2, 0, 1]), {}),
        (aten.expand.default, (r(5, 1), [3, 5, 4]), {}),
        (aten.unsqueeze.default, (x, 1), {}),
        (aten.mm.default, (m, r(7, 4)), {}),
        (aten.bmm.default, (x, r(3, 7, 2)), {}),
        (aten.addmm.default, (r(4), m, r(7, 4)), {"beta": 0.5, "alpha": 2.0}),
        (aten.clone.default, (x.transpose(0, 2),), {"memory_format": torch.contiguous_format}),
        (aten.cat.default, ([x, r(3, 2, 7)], 1), {}),
        (aten.sum.dim_IntList, (x, [0, 1], True), {"dtype": torch.float64}),
        (aten.sum.dim_IntList, (x, None), {}),
        (aten.gelu.default, (x,), {"approximate": "tanh"}),
        (aten.add.Tensor, (x, m), {"alpha": 3}),
        (aten.mul.Tensor, (x, m), {}),
        (aten.empty.memory_format, ([2, 3],), {"dtype": torch.float16, "device": torch.device("cpu"),
                                                "pin_memory": False}),
    ]


def test_each_binding_computes_its_overload():
    tested = set()
    for overload, args, kwargs in _binding_cases():
        expected, got = overload(*args, **kwargs), BINDINGS[overload](*args, **kwargs)
        assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype), overload
        if overload is not torch.ops.aten.empty.memory_format:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            # a view stays a view of the same memory, a new tensor new memory
            first = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
            assert (got.data_ptr() == first.data_ptr()) == (expected.data_ptr() == first.data_ptr()), overload
        tested.add(overload)
    assert tested == set(BINDINGS)


def test_the_graph_run_calls_the_bindings_and_the_reported_graph_keeps_the_overloads():
    def f(a, b):
        return torch.ops.aten.view.default(torch.ops.aten.mm.default(a, b), [-1])

    module = torch.fx.symbolic_trace(f)
    run = runnable(module)
    targets = [n.target for n in run.graph.nodes if n.op == "call_function"]
    assert targets == [torch.mm, torch.Tensor.view]
    assert [n.target for n in module.graph.nodes if n.op == "call_function"] == [
        torch.ops.aten.mm.default, torch.ops.aten.view.default]
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(run(a, b), (a @ b).view(-1), rtol=0, atol=0)
