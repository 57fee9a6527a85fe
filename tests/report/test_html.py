"""``report.save_html(path)``: one self-contained page with the tables and a roofline chart."""
from __future__ import annotations

import importlib.util
import math
import re
import sys

import pytest
import torch

import fusepass


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


@pytest.fixture(scope="module")
def report():
    q, k, v = (torch.randn(2, 3, 32, 16, requires_grad=True) for _ in range(3))
    fusepass.reset()
    y = torch.compile(attention, backend="fusepass")(q, k, v)
    (y * torch.sigmoid(y)).sum().backward()
    return fusepass.last_report()


def assert_self_contained(html: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert not re.search(r"url\((?!#)", html) and "@import" not in html  # only references inside the page


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the chart needs matplotlib")
def test_page_with_tables_and_a_roofline_chart(report, tmp_path):
    path = tmp_path / "report.html"
    report.save_html(str(path))
    html = path.read_text()
    assert html.count("<table>") == 1 and "<svg" in html and "Roofline: NVIDIA H200" not in html.split("<svg")[0]
    assert "attention" in html and "backward" in html and "3.67 TB/s" in html
    assert_self_contained(html)


def test_without_matplotlib_the_page_says_how_to_get_the_chart(report, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = tmp_path / "report.html"
    report.save_html(str(path))
    html = path.read_text()
    assert "<svg" not in html and "pip install fusepass[html]" in html and "<table>" in html
    assert_self_contained(html)
