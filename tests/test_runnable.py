"""`on_device`: a compiled graph runs with its tensors' CUDA device current (Triton launches on the current
device); checked with the CUDA device calls recorded, so it runs on any machine."""
import contextlib

import torch

from fusepass.runnable import on_device


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
