"""Code Dynamo finds no source for (a `python -c` string, an exec'd one) records no stack trace: the rewrite
must neither lose the attention nor break AOTAutograd's tracing of the backward, and the report says "?"."""
from __future__ import annotations

import torch
from support import check, missed, random_tensor

SOURCE = """
def attention(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(torch.tanh(s / 5.0) * 5.0, -1) @ v
"""


def test_attention_without_a_source_line_trains_fused():
    namespace = {"torch": torch}
    exec(compile(SOURCE, "<string>", "exec"), namespace)
    q, k, v = (random_tensor((1, 2, 19, 16), torch.float32) for _ in range(3))
    report = check(namespace["attention"], q, k, v, backward=True)
    attention = [r for r in report.rewrites if r.kind == "attention"]
    assert [r.phase for r in attention] == ["forward", "backward"] and not missed(report)
    assert {r.location for r in attention} == {"?"}
