"""FUSEPASS_REPORT prints or appends each report once it is complete; ``python -m fusepass report``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support import random_tensor

import fusepass
from fusepass.report.report import Report


def chain(x):
    return torch.exp(x * 2) + 1


def test_printed_when_complete_after_the_backward(monkeypatch, capsys):
    monkeypatch.setenv("FUSEPASS_REPORT", "1")
    fusepass.reset()
    x = random_tensor((8, 8), torch.float32).requires_grad_()
    y = torch.compile(chain, backend="fusepass")(x)
    assert not fusepass.last_report().complete
    assert "fusepass report" not in capsys.readouterr().err  # the backward graph is not compiled yet
    y.sum().backward()
    err = capsys.readouterr().err
    assert fusepass.last_report().complete and err.count("fusepass report - graph 0") == 1
    assert "elementwise backward" in err
    with torch.no_grad():  # no backward graph: complete once the forward one is compiled
        torch.compile(lambda x: torch.sin(x) * 3, backend="fusepass")(x)
    assert capsys.readouterr().err.count("fusepass report - graph 1") == 1


def test_appended_as_json_lines(monkeypatch, tmp_path):
    path = tmp_path / "reports.json"
    monkeypatch.setenv("FUSEPASS_REPORT", str(path))
    fusepass.reset()
    x = random_tensor((8, 8), torch.float32)
    torch.compile(chain, backend="fusepass")(x)
    torch.compile(lambda x: torch.sin(x) * 3, backend="fusepass")(x)
    lines = path.read_text().splitlines()
    assert [Report.from_dict(json.loads(line)).graph for line in lines] == ["graph 0", "graph 1"]
    assert json.loads(lines[0]) == fusepass.reports()[0].to_dict()


SCRIPT = """
import sys, torch
print("args", sys.argv[1:])
f = torch.compile(lambda x: torch.exp(x * 2) + 1, backend="fusepass")
y = f(torch.randn(8, 8, requires_grad=True))  # a backward that never runs
sys.exit(int(sys.argv[1]))
"""


def test_the_command_line_runs_a_script_and_prints_every_report(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    path = tmp_path / "reports.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "FUSEPASS_REPORT": str(path)}
    out = subprocess.run([sys.executable, "-m", "fusepass", "report", str(script), "3", "--flag"], env=env,
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 3, out.stderr
    assert "args ['3', '--flag']" in out.stdout
    assert "fusepass: 1 graph compiled" in out.stdout
    assert "fusepass report - graph 0" in out.stdout and "elementwise forward" in out.stdout
    # Never complete (no backward ran): published at exit, saying so.
    (line,) = path.read_text().splitlines()
    data = json.loads(line)
    assert not data["complete"] and "no backward ran" in data["notices"][-1]


def test_a_report_path_that_cannot_be_written_only_warns(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEPASS_REPORT", str(tmp_path / "missing-dir" / "reports.jsonl"))
    x = random_tensor((8, 8), torch.float32).requires_grad_()
    y = torch.compile(chain, backend="fusepass")(x)
    with pytest.warns(RuntimeWarning, match="the report could not be written"):
        y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.exp(x.detach() * 2))


def test_ceilings_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match="hbm_bytes_per_s must be a positive finite number"):
        fusepass.Ceilings("broken", 0.0, 1e12, 10)
    with pytest.raises(ValueError, match="sms must be a positive int"):
        fusepass.Ceilings("broken", 1e12, 1e12, 0)
