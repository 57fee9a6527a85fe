"""fusepass.profile: measured time given to the report's records, beside their roofline estimates."""
from __future__ import annotations

import expecttest
import pytest
import torch
from support import DEVICE

import fusepass
from fusepass.profiling import Profile, ProfiledRow
from fusepass.report import attribution
from fusepass.report.roofline import H200


class Block(torch.nn.Module):
    """LayerNorm, hand-written attention, GELU and a residual: every kind of record."""

    def __init__(self, d: int = 40, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5, dim=-1) @ v
        return x + self.out(torch.nn.functional.gelu(a.transpose(1, 2).reshape(b, n, d)))


class Mlp(torch.nn.Module):
    """A layer with a graph break: its compiled graphs run once per layer."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.up(x)) * 1.5
        torch._dynamo.graph_break()
        return x + h[..., : x.shape[-1]].tanh()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_every_rewrite_and_matmul_is_measured_and_gradients_are_kept():
    torch.manual_seed(0)
    model = Block().to(DEVICE)
    kept = torch.full_like(model.out.bias, 3.0)
    model.out.bias.grad = kept
    result = fusepass.profile(model, torch.randn(2, 37, 40, device=DEVICE), loss=_loss, steps=2)
    rewrites = [r for report in result.reports for r in report.rewrites]
    assert {(r.kind, r.phase) for r in rewrites} >= {("attention", "forward"), ("attention", "backward"),
                                                    ("reduction", "forward"), ("reduction", "backward")}
    measured = {(r.kind, r.record, r.phase) for r in result.rows if r.measured_ms > 0 and r.calls == 1}
    for r in rewrites:
        assert (r.kind, "rewrite", r.phase) in measured
    assert ("matmul", "hotspot", "forward") in measured and ("matmul", "hotspot", "backward") in measured
    assert all(r.estimated_ms is not None for r in result.rows if r.record != "op")
    assert 0 < result.attributed_ms <= result.total_ms
    # The profiled steps' gradients are not left behind: the one set before is as it was, the others None.
    assert model.out.bias.grad is kept and torch.equal(kept, torch.full_like(kept, 3.0))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "out.bias")
    assert "| attention rewrite: " in str(result) and set(result.to_dict()) >= {"rows", "total_ms", "steps"}


def test_a_graph_run_once_per_layer_counts_its_calls():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(Mlp(), Mlp(), Mlp()).to(DEVICE)
    result = fusepass.profile(layers, torch.randn(5, 24, device=DEVICE))
    fused = [r for r in result.rows if r.record == "rewrite"]
    assert fused and all(r.calls == 3 and r.phase == "forward" for r in fused)


def test_unannotated_graphs_run_no_ranges():
    model = torch.compile(Mlp().to(DEVICE), backend="fusepass")
    x = torch.randn(5, 24, device=DEVICE)
    model(x)
    with torch.profiler.profile() as profiler:
        model(x)
    assert not [e.name for e in profiler.events() if e.name.startswith(attribution.PREFIX)]


def test_steps_and_options_are_checked():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        fusepass.profile(Mlp(), torch.randn(5, 24), steps=0)
    with pytest.raises(TypeError, match="unknown option 'fuse'"):
        fusepass.profile(Mlp(), torch.randn(5, 24), fuse=True)


class Table(expecttest.TestCase):
    def test_rows_far_from_their_roofline_are_flagged_with_their_bound(self):
        rows = [ProfiledRow("matmul", "hotspot", "forward", "model.py:88", "matmul 8192×768 @ 768×50257: ATen's GEMM",
                            1, 6.6, 0.92, 10 ** 9, 632 * 10 ** 9),
                ProfiledRow("reduction", "rewrite", "backward", "model.py:40", "13 ops", 12, 1.2, 0.9, 3 * 10 ** 9, 0),
                ProfiledRow("op", "op", "forward", "?", "aten.clone", 1, 0.05, None, 0, 0)]
        profile = Profile(rows, 3, True, 8.0, [], H200)
        assert [r.kind for r in profile.flagged] == ["matmul"]
        self.assertExpectedInline(str(profile), """\
fusepass profile: 3 steps, device time 8.000 ms per step, 7.850 ms (98%) in the compiled graphs' ops
| what | phase | where | calls | estimated | measured | of roofline | bytes | bound |
|---|---|---|---|---|---|---|---|---|
| matmul hotspot: matmul 8192×768 @ 768×50257: ATen's GEMM | forward | model.py:88 | 1 | 920 us | 6.6 ms | 14% ⚠ | 953.7 MiB | compute-bound: 95.8 of 685 TFLOP/s |
| reduction rewrite: 13 ops | backward | model.py:40 | 12 | 900 us | 1.2 ms | 75% | 2.8 GiB | memory-bound: 2.5 of 3.67 TB/s |
| aten.clone: in no record | forward | ? | 1 |  | 50 us |  | 0 B |  |
outside the compiled graphs' ops (eager code around the model, the loss if not compiled, the optimizer): 0.150 ms per step
⚠ 1 row under 30% of the roofline: far from what their bytes and flops allow, not at a hardware limit""")

    def test_a_flagged_row_kernel_shows_its_layout(self):
        """A reduction far from its roofline says how its kernel lays the rows out (`row_kernel.row_layout`): there
        the cause is often found (lanes past a row's end, a column walk's rows one after another)."""
        layout = ("rows of 2304 held 1 x 4096 a program, 8 warps (44% of the lanes past the row); column sums by "
                  "264 programs, 32 tiles of 1 row each, one after another")
        rows = [ProfiledRow("reduction", "rewrite", "backward", "gemma2.py:40", "21 ops", 7, 1.2, 0.2, 7 * 10 ** 8, 0,
                            layout),
                ProfiledRow("reduction", "rewrite", "forward", "gemma2.py:40", "10 ops", 7, 0.3, 0.2, 4 * 10 ** 8, 0,
                            "rows of 2304 held 1 x 4096 a program, 8 warps (44% of the lanes past the row)")]
        lines = str(Profile(rows, 3, True, 2.0, [], H200)).splitlines()
        self.assertExpectedInline("\n".join(lines[3:5]), """\
| reduction rewrite: 21 ops | backward | gemma2.py:40 | 7 | 200 us | 1.2 ms | 17% ⚠ | 667.6 MiB | memory-bound: 0.583 of 3.67 TB/s; rows of 2304 held 1 x 4096 a program, 8 warps (44% of the lanes past the row); column sums by 264 programs, 32 tiles of 1 row each, one after another |
| reduction rewrite: 10 ops | forward | gemma2.py:40 | 7 | 200 us | 300 us | 67% | 381.5 MiB | memory-bound: 1.33 of 3.67 TB/s |""")

    def test_a_step_waiting_on_the_host_is_called_host_bound(self):
        rows = [ProfiledRow("attention", "rewrite", "forward", "model.py:12", "9 ops", 12, 2.0, 1.5, 10 ** 9, 10 ** 12)]
        assert not Profile(rows, 3, True, 8.0, [], H200, wall_ms=10.0).host_bound
        assert not Profile(rows, 3, False, 8.0, [], H200).host_bound  # host times: nothing to compare
        profile = Profile(rows, 3, True, 8.86, [], H200, wall_ms=30.3)
        assert profile.host_bound
        self.assertExpectedInline(str(profile).splitlines()[-1], """\
⚠ host-bound: kernels ran 8.860 ms of a step's 30.300 ms (timed without the profiler, with its ranges); the GPU waits on Python, ATen's calls and launches for the rest. Whole-graph replays (fusepass.backend(graphs=True), the default, off while profiling) remove most of it""")
