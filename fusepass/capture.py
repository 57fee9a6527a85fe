"""Dynamo's torch-level graph → a functional ATen graph, traced before autograd.

Every pass then reads one op vocabulary (``aten.matmul``, ``aten.softmax.int``, ``aten.to.dtype``, …) that
still looks like the user's code, with the user's source line in each node's ``meta["stack_trace"]``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def fake_mode_of(example_inputs: Sequence[object]) -> FakeTensorMode:
    return detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)


def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> torch.fx.GraphModule:
    fake_mode = fake_mode_of(example_inputs)
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode, torch.fx.traceback.preserve_node_meta():
        traced = make_fx(torch.fx.Interpreter(gm).run, pre_dispatch=True)(*fake_inputs)
    return traced
