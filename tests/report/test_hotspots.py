"""What was left unfused and why, ranked by estimated time, each at the user's file:line."""
from __future__ import annotations

import torch
from support import missed, random_tensor

import fusepass


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "def " not in line)


def near_misses(q, k, v, x):
    p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    returned = p @ v
    over_queries = torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v
    return returned, p, over_queries, torch.special.xlog1py(x, x + 1) * 3


def test_near_misses_and_unfused_ops_ranked_by_estimated_time():
    q, k, v = (random_tensor((2, 2, 64, 16), torch.float32) for _ in range(3))
    x = random_tensor((8, 8), torch.float32)
    fusepass.reset()
    torch.compile(near_misses, backend="fusepass")(q, k, v, x)
    report = fusepass.last_report()
    ranked = [h for h in report.ranked_hotspots if h in missed(report)]
    assert [(h.kind, h.reason) for h in ranked] == [
        ("attention", "probabilities also used by aten.matmul, output"),
        ("attention", "softmax over dim -2, not the key axis"),
        ("elementwise", "no Triton translation for aten.special_xlog1py.default"),
    ]
    assert [h.time_ms for h in ranked] == sorted((h.time_ms for h in ranked), reverse=True)
    here = "tests/report/test_hotspots.py"
    assert ranked[0].location == f"{here}:{_line_of('p = torch.softmax')}"
    assert ranked[1].location == f"{here}:{_line_of('dim=-2')}"
    assert ranked[2].location == f"{here}:{_line_of('torch.special.xlog1py')}"
    # The scores and probabilities it still writes and reads: four N×N fp32 tensors per head.
    assert ranked[0].bytes == 4 * 2 * 2 * 64 * 64 * 4
    text = str(report)
    assert text.index("probabilities also used") < text.index("dim -2") < text.index("xlog1py")


def three_large_intermediates(x):
    a = torch.exp(x)
    b = torch.cumsum(a, 0)
    c = torch.cumsum(b[:256], 0)
    return torch.cos(b), c.sum()


def test_the_largest_remaining_intermediates():
    x = random_tensor((1024, 512), torch.float32)  # 2 MiB
    fusepass.reset()
    torch.compile(three_large_intermediates, backend=fusepass.backend(elementwise=False))(x)
    hotspots = [h for h in fusepass.last_report().ranked_hotspots if h.kind == "intermediate"]
    # exp's and cumsum's outputs are written and read back; cos's is the output; the small cumsum's
    # 512 KiB are below the threshold.
    assert [(h.ops, h.bytes) for h in hotspots] == [(("aten.cumsum",), 3 * (2 << 20)),
                                                    (("aten.exp",), 2 * (2 << 20))]
    assert hotspots[0].reason == "1024x512 float32 written by aten.cumsum, read by 2 ops"
    assert hotspots[0].location.endswith(f"test_hotspots.py:{_line_of('b = torch.cumsum')}")
