"""``str(report)``: a stable table (snapshots), readable on a 100-column terminal."""
from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn.functional as F
from support import random_tensor

import fusepass
from fusepass.report import roofline
from fusepass.report.records import Hotspot, Rewrite
from fusepass.report.report import Report


def hand_made_report() -> Report:
    report = Report(graph="graph 3", device="cuda:0",
                    notices=["a notice long enough to be wrapped: " + "word " * 16])
    report.rewrites = [
        Rewrite(kind="attention", phase="forward", location="model.py:12",
                ops=("aten.matmul", "aten.div", "aten.softmax", "aten.matmul"), bytes_unfused=138_412_032,
                bytes_fused=4_719_585, bytes_ideal=4_194_304, flops=8_640_266_240, flops_fused=8_640_266_240,
                activation_bytes_saved=32_473_088, features=("causal", "softcap")),
        Rewrite(kind="elementwise", phase="backward", location="model.py:30", ops=("aten.mul",) * 3,
                bytes_unfused=3 << 20, bytes_fused=1 << 20, bytes_ideal=1 << 20, flops=3 << 18,
                flops_fused=3 << 18, measured_unfused_ms=0.012, measured_fused_ms=0.004),
    ]
    report.hotspots = [
        Hotspot(kind="elementwise", phase="forward", location="model.py:31", reason="no Triton translation for "
                "aten.special_xlog1py.default", ops=("aten.special_xlog1py",), bytes=3 << 20, flops=1 << 18),
        Hotspot(kind="attention", phase="forward", location="model.py:40", reason="probabilities also used by "
                "output", ops=("aten.softmax",), bytes=128 << 20),
    ]
    roofline.estimate(report)
    return report


def assert_fits(text: str) -> None:
    assert max(len(line) for line in text.splitlines()) <= 100, text


def attention_and_chain(q, k, v, w):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return F.gelu(o * w + 1) * torch.sigmoid(o)


class Table(expecttest.TestCase):
    def test_more_kept_for_backward(self):
        """A fused op that keeps more for the backward than the ops it replaced (its output and row statistics
        against a short sequence's probabilities) says so, with the amount."""
        rewrite = Rewrite(kind="attention", phase="forward", location="model.py:12", ops=("aten.softmax",),
                          bytes_unfused=1 << 20, bytes_fused=1 << 19, activation_bytes_saved=-(526 << 10))
        report = Report(graph="graph 0", device="cpu")
        report.rewrites = [rewrite]
        roofline.estimate(report)
        self.assertIn("model.py:12 | 1 op | 0 FLOP | 526.0 KiB more kept for backward", str(report))

    def test_hand_made_report(self):
        text = str(hand_made_report())
        assert_fits(text)
        self.assertExpectedInline(text, """\
fusepass report - graph 3 on cuda:0: 2 rewrites, 2 hotspots
roofline: NVIDIA H200 (measured copy and bf16 matmul), 3.67 TB/s, 685 TFLOP/s (default)
note: a notice long enough to be wrapped: word word word word word word word word word word word
  word word word word word

rewrites                          HBM bytes                 FLOP/B           est. time
                          unfused      fused      saved  unfused   fused   unfused     fused
  attention   forward   132.0 MiB    4.5 MiB  127.5 MiB     62.4    1831   37.7 us   12.6 us
      model.py:12 | 4 ops | 8.64 GFLOP | 31.0 MiB less kept for backward | causal, softcap
  elementwise backward    3.0 MiB    1.0 MiB    2.0 MiB     0.25    0.75    857 ns    286 ns
      model.py:30 | 3 ops | 786 kFLOP | measured 12 us -> 4 us (3.00x)
  total                 135.0 MiB    5.5 MiB  129.5 MiB                    38.6 us   12.9 us

hotspots, by estimated time              HBM      est.
  attention    forward   128.0 MiB   36.6 us  model.py:40  probabilities also used by output
  elementwise  forward     3.0 MiB    857 ns  model.py:31
      no Triton translation for aten.special_xlog1py.default""")

    @pytest.mark.skipif(torch.cuda.is_available(), reason="device names and notices differ on a GPU")
    def test_compiled_attention_and_chain(self):
        q, k, v = (random_tensor((1, 2, 32, 16), torch.float32).requires_grad_() for _ in range(3))
        w = random_tensor((16,), torch.float32).requires_grad_()
        fusepass.reset()
        torch.compile(attention_and_chain, backend="fusepass")(q, k, v, w).sum().backward()
        text = str(fusepass.last_report())
        assert_fits(text)
        self.assertExpectedInline(text, """\
fusepass report - graph 0 on cpu: 4 rewrites, 0 hotspots
roofline: NVIDIA H200 (measured copy and bf16 matmul), 3.67 TB/s, 685 TFLOP/s (default)

rewrites                          HBM bytes                 FLOP/B           est. time
                          unfused      fused      saved  unfused   fused   unfused     fused
  attention   forward    86.0 KiB   16.6 KiB   69.4 KiB     1.64    8.51     24 ns   4.62 ns
      tests/report/test_table.py:48 | 8 ops | 144 kFLOP | 4.4 KiB less kept for backward | causal
  attention   backward  121.0 KiB   49.5 KiB   71.5 KiB     2.21    10.1   33.8 ns   13.8 ns
      tests/report/test_table.py:48 | 7 ops | 274 kFLOP | causal
  elementwise forward    44.1 KiB    8.1 KiB   36.0 KiB     0.11    0.62   12.3 ns   2.25 ns
      tests/report/test_table.py:49 | 5 ops | 5.12 kFLOP
  reduction   backward  116.2 KiB   12.2 KiB  103.9 KiB     0.09    0.90   32.4 ns   3.42 ns
      tests/report/test_table.py:49 | 12 ops | 11.3 kFLOP
  total                 367.2 KiB   86.4 KiB  280.9 KiB                     102 ns   24.1 ns""")
