"""The backend as users meet it: registration, options, fallbacks, devices, the rewritten graph."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import expecttest
import pytest
import torch
import torch.nn.functional as F
from support import assert_close, broken_source, check, missed, random_tensor, rewrites

import fusepass
from fusepass.elementwise import kernel as pointwise


def chain(x, b):
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


def test_backend_is_registered_by_name():
    assert "fusepass" in torch._dynamo.list_backends()


def test_unknown_option_names_the_option():
    with pytest.raises(TypeError, match="unknown option 'elementwsie'"):
        fusepass.backend(elementwsie=False)


@pytest.mark.parametrize("options", [{"elementwise": "no"}, {"strict": 2}, {"attention": None}, {"replay": 1}])
def test_option_values_are_checked(options):
    ((name, value),) = options.items()
    with pytest.raises(TypeError, match=f"option '{name}' takes True or False, not {value!r}"):
        fusepass.backend(**options)
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    with pytest.raises(Exception, match=f"option '{name}' takes True or False"):
        torch.compile(chain, backend="fusepass", options=options)(x, b)


def test_elementwise_can_be_switched_off():
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    report = check(chain, x, b, backend=fusepass.backend(elementwise=False))
    assert not report.rewrites


def test_torch_compile_passes_options_over_the_backends():
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    fusepass.reset()
    compiled = torch.compile(chain, backend=fusepass.backend(strict=True), options={"elementwise": False})
    assert_close(compiled(x, b), chain(x, b))
    assert not fusepass.last_report().rewrites
    with pytest.raises(Exception, match="unknown option 'elementwsie'"):
        torch.compile(chain, backend="fusepass", options={"elementwsie": False})(x, b)


def test_modes_fusepass_has_no_counterpart_of_are_refused_by_name():
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    assert_close(torch.compile(chain, backend="fusepass", mode="default")(x, b), chain(x, b))
    with pytest.raises(Exception, match="no mode 'max-autotune': its kernels' tiles are chosen"):
        torch.compile(chain, backend="fusepass", mode="max-autotune")(x, b)


def test_reports_in_compile_order_and_reset():
    fusepass.reset()
    x = random_tensor((4, 4), torch.float32)
    torch.compile(lambda x: torch.exp(x) * 2 + 1, backend="fusepass")(x)
    torch.compile(lambda x: torch.sin(x) * 3 - 1, backend="fusepass")(x)
    assert [r.graph for r in fusepass.reports()] == ["graph 0", "graph 1"]
    assert fusepass.last_report() is fusepass.reports()[-1]
    fusepass.reset()
    assert fusepass.reports() == [] and fusepass.last_report() is None


def test_a_kernel_that_fails_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(pointwise, "kernel_source", broken_source)
    monkeypatch.setattr(pointwise, "_kernels", {})
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    with pytest.warns(RuntimeWarning, match="running it unfused"):
        report = check(chain, x, b)
    (hotspot,) = missed(report)
    assert hotspot.kind == "elementwise" and "failed" in hotspot.reason


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setattr(pointwise, "kernel_source", broken_source)
    monkeypatch.setattr(pointwise, "_kernels", {})
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    with pytest.raises(SyntaxError):
        torch.compile(chain, backend=fusepass.backend(strict=True))(x, b)


def test_a_pass_that_fails_leaves_the_graph_unfused(monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr("fusepass.elementwise.fuse.partition", explode)
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    with pytest.warns(RuntimeWarning, match="planted"):
        report = check(chain, x, b, backward=True)
    assert not report.rewrites
    assert all("planted" in h.reason for h in missed(report))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's behaviour")
def test_cpu_without_the_interpreter_plans_reports_and_runs_unfused(tmp_path):
    script = tmp_path / "plain_cpu.py"
    script.write_text(textwrap.dedent("""
        import torch, fusepass
        def f(x):
            return torch.exp(x * 2) + 1
        x = torch.randn(8, 8)
        y = torch.compile(f, backend="fusepass")(x)
        torch.testing.assert_close(y, f(x))
        report = fusepass.last_report()
        print(len(report.rewrites), report.notices[0])
        print(any(type(n.target).__name__ == "PointwiseLauncher" for n in report.graphs["forward"].graph.nodes))
    """))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    count, rest = out.stdout.split(" ", 1)
    assert count == "1"
    assert "kernels need a CUDA device" in rest
    assert out.stdout.strip().endswith("False")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's behaviour")
def test_the_interpreter_asked_for_after_the_import_is_told_and_nothing_fails(tmp_path):
    """Triton's decorator chose compiled mode for fusepass's kernels at its import: a TRITON_INTERPRET=1 set later
    runs the graph unfused, as without it, and the report says to set it before the import."""
    script = tmp_path / "late_interpreter.py"
    script.write_text(textwrap.dedent("""
        import os, warnings
        import torch, fusepass
        from fusepass.pipeline import LATE_INTERPRETER_NOTICE
        os.environ["TRITON_INTERPRET"] = "1"
        def f(x):
            return torch.softmax(torch.exp(x * 2) + 1, dim=-1)
        x = torch.randn(8, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = torch.compile(f, backend="fusepass")(x)
        torch.testing.assert_close(y, f(x))
        print(LATE_INTERPRETER_NOTICE in fusepass.last_report().notices)
    """))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


class RewrittenGraph(expecttest.TestCase):
    def test_snapshot_of_forward_and_backward(self):
        x = random_tensor((8, 6), torch.float32)
        b = random_tensor((6,), torch.float32)
        report = check(chain, x, b, backward=True)
        self.assertExpectedInline(str(report.graphs["forward"].graph).strip(), """\
graph():
    %primals_1 : [num_users=2] = placeholder[target=primals_1]
    %primals_2 : [num_users=2] = placeholder[target=primals_2]
    %fused_mul_add_gelu_sigmoid : [num_users=1] = call_function[target=fusepass.elementwise.kernel.fused_mul_add_gelu_sigmoid](args = (%primals_1, %primals_2), kwargs = {})
    %getitem : [num_users=1] = call_function[target=operator.getitem](args = (%fused_mul_add_gelu_sigmoid, 0), kwargs = {})
    return (getitem, primals_1, primals_2)""")
        self.assertEqual(len(rewrites(report, kind="reduction", phase="backward")), 1)  # b's gradient summed in it


class ScaledTanh(torch.autograd.Function):
    """An autograd.Function with a backward of its own (deliberately not tanh's true derivative)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x) * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 + x


def test_autograd_functions_keep_their_own_backward():
    def fn(x):
        return torch.sigmoid(ScaledTanh.apply(x * 1.5 + 1) * 0.5) - 1

    report = check(fn, random_tensor((6, 7), torch.float32), backward=True)
    assert report.rewrites  # the chains around the function are still fused


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's behaviour")
def test_cpu_without_the_interpreter_counts_a_planned_attention_once(tmp_path):
    script = tmp_path / "plain_cpu_attention.py"
    script.write_text(textwrap.dedent("""
        import torch, fusepass
        def f(q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2) * 0.125 - 0.5, dim=-1) @ v
        q, k, v = (torch.randn(2, 3, 16, 16, requires_grad=True) for _ in range(3))
        out = torch.compile(f, backend="fusepass")(q, k, v)
        out.sum().backward()
        torch.testing.assert_close(out, f(q, k, v))
        print(sorted({r.kind for r in fusepass.last_report().rewrites}))
    """))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['attention']"  # the score chain is not also an elementwise group


def test_a_long_compile_says_what_compiles():
    from fusepass.pipeline import LONG_COMPILE_KERNELS, compile_notice
    from fusepass.report.records import Rewrite

    report = fusepass.Report(graph="graph 3", device="cuda")
    report.rewrites = [Rewrite(kind="attention" if i < 2 else "elementwise", phase="forward", location="m.py:1",
                               ops=("aten.mul",), bytes_unfused=2, bytes_fused=1) for i in range(LONG_COMPILE_KERNELS)]
    notice = compile_notice(report, "forward", torch.device("cuda"))
    assert notice == (f"fusepass: graph 3 (forward) compiles {LONG_COMPILE_KERNELS} kernels on its first call "
                      f"(2 attention, {LONG_COMPILE_KERNELS - 2} fused); Triton caches them for later runs")
    assert compile_notice(report, "backward", torch.device("cuda")) is None
    assert compile_notice(report, "forward", torch.device("cpu")) is None  # the interpreter compiles nothing
