"""The ops a compiled graph leaves to ATen are hotspots: matmuls with their FLOPs, the rest with what kept them out
of a fused kernel, so that the report accounts for the whole step."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from support import DEVICE, random_tensor

import fusepass

STRICT = fusepass.backend(strict=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24)

    def forward(self, x):  # a scan and a mean over the positions: ATen's, each a hotspot
        return x + self.down(F.gelu(self.up(self.norm(x))) * 2) + torch.cumsum(x, -1) * x.mean(1, keepdim=True)


def _compiled_report(fn, *inputs, backend=STRICT):
    fusepass.reset()
    inputs = [x.requires_grad_() for x in inputs]
    torch.compile(fn, backend=backend)(*inputs).sum().backward()
    return fusepass.last_report()


def test_matmuls_and_aten_ops_are_hotspots_with_their_cost():
    report = _compiled_report(Block().to(DEVICE), random_tensor((3, 5, 24), torch.float32))
    matmuls = [h for h in report.hotspots if h.kind == "matmul"]
    forward = [h for h in matmuls if h.phase == "forward"]
    assert len(forward) == 2 and all(h.flops > 0 and h.bytes > 0 and h.time_ms > 0 for h in forward)
    assert any("15×24 @ 24×40" in h.reason for h in forward)  # the up projection, as ATen runs it
    assert len([h for h in matmuls if h.phase == "backward"]) == 4  # dX and dW of each
    scan = [h for h in report.hotspots if h.ops == ("aten.cumsum",)]
    assert scan and "no fusion rule" in scan[0].reason and scan[0].location.endswith("test_aten_ops.py:23")
    # the mean over the positions: neither a row nor every leading dim (the norm's and the biases' gradients,
    # sums over every leading dim, are summed in row kernels)
    assert any(h.kind == "aten" and "other dims than the last" in h.reason for h in report.hotspots)
    assert not [h for h in report.hotspots if h.ops == ("aten.native_layer_norm_backward",)]


def test_fused_ops_are_not_listed_again():
    report = _compiled_report(lambda x: torch.sigmoid(x * 2 + 1) * x, random_tensor((7, 9), torch.float32))
    assert report.rewrites and not [h for h in report.hotspots if h.kind in ("aten", "matmul")]


def test_a_lone_op_says_it_has_no_fusable_neighbour():
    x = random_tensor((6, 8), torch.float32)
    report = _compiled_report(lambda x, w: torch.tanh(x @ w), x, random_tensor((8, 8), torch.float32))
    lone = [h for h in report.hotspots if h.ops == ("aten.tanh",)]
    assert lone and "no fusable neighbour" in lone[0].reason


def test_a_lone_op_across_a_reshaping_view_from_a_kernel_names_it():
    """A product viewed to another shape and added to a tensor of that shape: the add cannot join the product's
    group (a group holds one shape), and its hotspot says a fused neighbour lies across the view."""
    x, z = random_tensor((6, 4, 5), torch.float32), random_tensor((6, 4, 5), torch.float32)
    report = _compiled_report(lambda x, z, y: (torch.sin(x) * z).reshape(6, 20) + y, x, z,
                              random_tensor((6, 20), torch.float32))
    (lone,) = [h for h in report.hotspots if h.ops == ("aten.add",)]
    assert "fused neighbour lies across a view of another shape" in lone.reason


def test_without_elementwise_fusion_every_op_is_listed():
    report = _compiled_report(lambda x: torch.sigmoid(x * 2 + 1), random_tensor((7, 9), torch.float32),
                              backend=fusepass.backend(elementwise=False))
    listed = {h.ops[0] for h in report.hotspots if h.kind == "aten" and h.phase == "forward"}
    assert {"aten.mul", "aten.add", "aten.sigmoid"} <= listed
