"""Row reductions fused with the pointwise ops around them: numerics against eager and float64, forward and
backward, rows held whole and rows walked in chunks, the report and the rewritten graph, and what stays ATen."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from support import DEVICE, check, random_tensor, rewrites

import fusepass
from fusepass.elementwise import kernel as pointwise
from fusepass.elementwise import reduction, row_kernel

STRICT = fusepass.backend(strict=True)  # a kernel that fails raises: these tests see the kernels' values
aten = torch.ops.aten


@pytest.fixture(params=["whole rows", "walked rows"])
def row_form(request, monkeypatch):
    """Every test twice: rows held whole, and rows walked in chunks (the kernels of long rows, at test sizes)."""
    if request.param == "walked rows":
        monkeypatch.setattr(reduction, "PERSISTENT_MAX", 16)
        monkeypatch.setattr(row_kernel, "LOOP_BLOCK", 16)
    return request.param


class RMSNorm(nn.Module):
    """As Llama writes it: the fp32 upcast, the weight applied after the cast back."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(random_tensor((width,), dtype))
        self.eps = 1e-6

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(dtype)


def residual_rmsnorm(x, residual, weight):
    h = x + residual
    hf = h.float()
    return h, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight


def layer_norm_by_hand(x, weight, bias):
    """BERT's original: mean, then the mean of squared deviations."""
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    return weight * ((x - u) / torch.sqrt(s + 1e-12)) + bias


def softmax_by_hand(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def log_softmax_loss(logits, onehot):
    """A cross-entropy written out: log-sum-exp per row, the row's loss not kept dim."""
    m = logits.amax(-1, keepdim=True)
    lse = m + torch.log(torch.exp(logits - m).sum(-1, keepdim=True))
    return ((lse - logits) * onehot).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rmsnorm_is_one_kernel_each_way(row_form, dtype):
    x = random_tensor((3, 5, 37), dtype)
    norm = RMSNorm(37, dtype)
    report = check(lambda x, w: residual_rmsnorm(x, x * 0.5, w), x, norm.weight.detach(), backward=True,
                   backend=STRICT)
    (forward,) = rewrites(report, kind="reduction", phase="forward")
    assert "aten.mean" in forward.ops and "aten.rsqrt" in forward.ops
    assert forward.detail["shape"] == ["3", "5", "37"]
    (backward,) = rewrites(report, kind="reduction", phase="backward")  # the row sum of dy · x beside its ops
    if row_form == "whole rows":  # held 64 wide, 16 rows a program (PROGRAM_TILE); the weight's sums in the kernel
        assert forward.detail["row kernel"] == \
            "rows of 37 held 16 x 64 a program, 4 warps (42% of the lanes past the row)"
        assert backward.detail["row kernel"] == forward.detail["row kernel"] + \
            "; column sums by 1 program, 1 tile of 16 rows each, one after another"
    else:  # the weight's sums ATen's
        assert forward.detail["row kernel"] == backward.detail["row kernel"] == \
            "rows of 37 walked in chunks of 16, 4 warps"
    assert not [n for n in report.graphs["forward"].graph.nodes if n.target == aten.mean.dim]


@pytest.mark.parametrize("length", [300, 768])
def test_short_rows_take_their_layout(length):
    """Rows whose tile is 256 to 1024 wide take `row_kernel.SHORT_ROWS`' rows and warps a program (a 512-wide tile
    two rows at one warp, a 1024-wide one a row at two); a kernel with column sums keeps PROGRAM_TILE at 4 warps."""
    x, weight = random_tensor((3, 5, length), torch.float32), random_tensor((length,), torch.float32)
    report = check(lambda x, w: torch.nn.functional.layer_norm(x, (length,), w), x, weight, backward=True,
                   backend=STRICT)
    (forward,) = rewrites(report, kind="reduction", phase="forward")
    (backward,) = rewrites(report, kind="reduction", phase="backward")
    rblock, held, warps = (512, 2, "1 warp") if length == 300 else (1024, 1, "2 warps")
    past = f"({1 - length / rblock:.0%} of the lanes past the row)"
    assert forward.detail["row kernel"] == f"rows of {length} held {held} x {rblock} a program, {warps} {past}"
    assert backward.detail["row kernel"].startswith(
        f"rows of {length} held {2048 // rblock} x {rblock} a program, 4 warps {past}; column sums by")


@pytest.fixture
def sources(monkeypatch):
    """The row kernels' sources as they are written (none cached from another test: each is written here)."""
    written = []
    source = row_kernel.row_kernel_source
    monkeypatch.setattr(row_kernel, "row_kernel_source", lambda *args: written.append(source(*args)) or written[-1])
    monkeypatch.setattr(pointwise, "_kernels", {})
    return written


def test_whole_rows_are_read_and_written_once(sources):
    """Held whole, a row's kernel loads each input once and stores each output once: no walk over the row."""
    check(RMSNorm(40, torch.bfloat16), random_tensor((6, 40), torch.bfloat16), backward=True, backend=STRICT)
    assert len(sources) == 2
    for text in sources:
        assert "for r0" not in text
        stores = text.count("tl.store(")
        assert stores == len(set(re.findall(r"tl\.store\((o\d+)_ptr", text))) > 0


def test_a_row_kernel_is_not_specialised_on_its_row_counts(sources):
    """Its leading sizes (a sequence's length among them) and row steps count rows, and the strides of a row's own
    values (the statistics the forward writes and the backward reads) place one value a row: no access along a row
    depends on them, and Triton would compile the kernel again at a length of another divisibility. The row's own
    length and the strides of what moves along it stay specialised: its masks' and its loads' alignment do."""
    x = random_tensor((2, 3, 40), torch.float32)
    check(torch.nn.LayerNorm(40).to(DEVICE), x, backward=True, backend=STRICT)  # its backward sums columns
    assert any("row_steps" in text for text in sources)
    for text in sources:
        (unspecialized,) = re.findall(r"do_not_specialize=\[([^\]]*)\]", text)
        names = set(re.findall(r"'(\w+)'", unspecialized))
        assert {"n0", "n1"} <= names and "n2" not in names
        assert ("row_steps" in names) == ("row_steps" in text)
        accesses = re.findall(r"tl\.(?:load|store)\(([lo]\d+)_ptr \+ ([^,]*),", text)
        assert any("c2" not in where for _, where in accesses)  # the statistics
        for operand, where in accesses:
            if "program_id" in where:  # a column sum's partial sums: one row of them a program
                continue
            strides = set(re.findall(rf"{operand}_s\d", where))
            assert strides <= names if "c2" not in where else not strides & names, (operand, where)


@pytest.mark.parametrize("fn, shape", [(softmax_by_hand, (4, 29)), (layer_norm_by_hand, (2, 3, 41))],
                         ids=["softmax", "layernorm"])
def test_chained_reductions(row_form, fn, shape):
    x = random_tensor(shape, torch.float32)
    if fn is softmax_by_hand:
        report = check(fn, x, backward=True, backend=STRICT)
    else:
        w, b = random_tensor(shape[-1:], torch.float32), random_tensor(shape[-1:], torch.float32)
        report = check(fn, x, w, b, backward=True, backend=STRICT)
    assert len(rewrites(report, kind="reduction", phase="forward")) == 1


def test_a_row_value_written_out_without_its_dimension(row_form):
    logits = random_tensor((6, 45), torch.float32)
    onehot = torch.nn.functional.one_hot(torch.arange(6, device=DEVICE) * 7 % 45, 45).float()
    report = check(log_softmax_loss, logits, onehot, backward=True, backend=STRICT)
    (forward,) = rewrites(report, kind="reduction", phase="forward")
    assert forward.ops.count("aten.sum") == 2


def test_maximum_and_minimum_propagate_nan(row_form):
    x = random_tensor((5, 23), torch.float32)
    x[1, 7] = float("nan")
    x[3, 22] = float("nan")
    fused = torch.compile(lambda x: (x.amax(-1) * 2, x.amin(-1, keepdim=True) - x), backend=STRICT)(x)
    eager = (x.amax(-1) * 2, x.amin(-1, keepdim=True) - x)
    for a, e in zip(fused, eager):
        torch.testing.assert_close(a, e, equal_nan=True)


def test_a_log_sum_exp_with_infinities_and_nan_is_eager_s(row_form):
    """Walked, the sum of exp(x − max) is taken beside the maximum, rescaled as it grows: rows of −inf (0 / 0, NaN
    as eager), a +inf, a NaN, and a maximum found only in a row's last chunk give eager's values."""
    x = random_tensor((6, 45), torch.float32)
    x[0] = float("-inf")
    x[1, 3] = float("inf")
    x[2, 40] = float("nan")
    x[3, :30] = float("-inf")
    x[4, 44] = 60.0

    def lse(x):
        m = x.amax(-1, keepdim=True)
        return m + torch.log(torch.exp(x - m).sum(-1, keepdim=True)), torch.softmax(x, -1)

    fused = torch.compile(lse, backend=STRICT)(x)
    for a, e in zip(fused, lse(x)):
        torch.testing.assert_close(a, e, equal_nan=True)


def test_sum_into_a_wider_dtype_and_a_model_module(row_form):
    x = random_tensor((7, 33), torch.bfloat16)
    check(lambda x: (x * 2).sum(-1, dtype=torch.float32) + 1, x, backend=STRICT)
    norm = RMSNorm(33, torch.float32)
    compiled = torch.compile(norm, backend=STRICT)
    y = random_tensor((2, 4, 33), torch.float32)
    compiled(y).sum().backward()
    assert norm.weight.grad is not None
    expected = norm.weight.grad.clone()
    norm.weight.grad = None
    norm(y).sum().backward()
    torch.testing.assert_close(expected, norm.weight.grad, rtol=1e-5, atol=1e-5)


def test_a_second_call_at_other_sizes_keeps_every_gradient(row_form):
    norm = RMSNorm(24, torch.float32)
    compiled = torch.compile(norm, backend=STRICT)
    for rows, width in ((3, 24), (7, 24), (11, 24)):
        x = random_tensor((rows, width), torch.float32).requires_grad_()
        compiled(x).square().sum().backward()
        got = (x.grad.clone(), norm.weight.grad.clone())
        x.grad, norm.weight.grad = None, None
        norm(x).square().sum().backward()
        torch.testing.assert_close(got[0], x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], norm.weight.grad, rtol=1e-5, atol=1e-5)
        x.grad, norm.weight.grad = None, None


def test_reductions_over_other_dimensions_stay_aten():
    """Neither the last dim (a row) nor every other (a column sum): a middle one."""
    x = random_tensor((4, 9, 13), torch.float32)
    report = check(lambda x: torch.exp(x * 2).sum(1) + 1, x, backend=STRICT)
    assert not rewrites(report, kind="reduction")
    graph = report.graphs["forward"].graph
    assert [n for n in graph.nodes if n.target == aten.sum.dim_IntList]


def test_a_row_value_read_in_another_row_is_not_fused_with_its_reader():
    x = random_tensor((12, 12), torch.float32)
    # The row sums read as a row vector: each element needs another row's sum.
    report = check(lambda x: torch.exp(x).sum(-1, keepdim=True).t() * x, x, backward=True, backend=STRICT)
    assert not rewrites(report, kind="reduction", phase="forward")
    assert [n for n in report.graphs["forward"].graph.nodes if n.target == aten.sum.dim_IntList]


def test_reductions_off_leaves_them_aten_and_fuses_the_rest():
    x = random_tensor((5, 19), torch.float32)
    report = check(softmax_by_hand, x, backward=True, backend=fusepass.backend(strict=True, reductions=False))
    assert not rewrites(report, kind="reduction")
    assert rewrites(report, phase="forward")  # exp(x - max) is still one pointwise kernel
    graph = report.graphs["forward"].graph
    assert [n for n in graph.nodes if n.target == aten.amax.default]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_family_ops_join_their_neighbours(row_form, dtype):
    x = random_tensor((4, 3, 27), dtype)

    def fn(x):
        probs = torch.softmax(x * 2, dim=-1)
        logp = torch.log_softmax(x.float() - 1, dim=-1)
        return probs * 3, logp.exp() + 1

    report = check(fn, x, backward=True, backend=STRICT)
    # for training, written out before the partition (softmax_loss): the backward recomputes from the input
    (forward,) = rewrites(report, kind="reduction", phase="forward")
    assert {"aten.amax", "aten.exp", "aten.log"} <= set(forward.ops)
    assert not {"aten._softmax", "aten._log_softmax"} & set(forward.ops)
    (backward,) = rewrites(report, kind="reduction", phase="backward")
    assert {"aten._softmax_backward_data", "aten._log_softmax_backward_data"} <= set(backward.ops)
    graph = report.graphs["backward"].graph
    assert not [n for n in graph.nodes if n.target == aten._softmax_backward_data.default]
    # for inference, each op expands in its kernel
    with torch.no_grad():
        report = check(fn, x, backend=STRICT)
    (forward,) = rewrites(report, kind="reduction", phase="forward")
    assert {"aten._softmax", "aten._log_softmax"} <= set(forward.ops)


def saved_full_size(report, shape):
    """The forward graph's outputs of `shape` that are not its inputs: what it writes for the backward to read."""
    graph = report.graphs["forward"].graph
    (outputs,) = graph.output_node().args
    return [n for n in outputs if isinstance(n, torch.fx.Node) and n.op != "placeholder" and
            tuple(n.meta["val"].shape) == tuple(shape)]


def test_one_row(row_form):
    """A root of rank 1: one row, its value written once."""
    x = random_tensor((29,), torch.float16)
    check(lambda x: (torch.sigmoid(x) * x.amax(-1, keepdim=True), (x * 2).sum(-1)), x, backward=True,
          backend=STRICT)


def residual_layer_norm(x, residual, weight, bias):
    h = x + residual
    return h, torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, 1e-5) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_joins_the_residual_add(row_form, dtype):
    x, r = random_tensor((3, 4, 37), dtype), random_tensor((3, 4, 37), dtype)
    w, b = random_tensor((37,), dtype), random_tensor((37,), dtype)
    report = check(residual_layer_norm, x, r, w, b, backward=True, backend=STRICT)
    (forward,) = rewrites(report, kind="reduction", phase="forward")
    assert forward.ops[0] == "aten.add" and forward.ops.count("aten.mean") == 2
    forward_graph = report.graphs["forward"].graph
    assert not [n for n in forward_graph.nodes if n.target == aten.native_layer_norm.default]
    # its backward too, the weight's and bias's gradients summed in the row kernel, where its rows are held whole
    backward_graph = report.graphs["backward"].graph
    norm_backward = [n for n in backward_graph.nodes if n.target == aten.native_layer_norm_backward.default]
    assert bool(norm_backward) == (row_form == "walked rows")
    if norm_backward:
        (left,) = [h for h in report.hotspots if "aten.native_layer_norm_backward" in h.ops]
        assert "rows longer than 16" in left.reason
    if row_form == "whole rows":
        (backward,) = rewrites(report, kind="reduction", phase="backward")
        assert backward.ops.count("aten.sum") == 2 and backward.ops.count("aten.mean") == 2


def test_a_half_layer_norm_rounds_once_as_eager():
    """Computed in float32 and rounded once, forward and backward, on the CPU too (where eager saves the mean and
    deviation in bf16): the output and the input's gradient as close to float64 as eager's (eager's CPU sums of
    the weight's gradient are further: `check` bounds those)."""
    inputs = [random_tensor(shape, torch.bfloat16).requires_grad_() for shape in ((40, 96), (96,), (96,))]

    def norm(x, w, b):
        return torch.nn.functional.layer_norm(x, (96,), w, b)

    check(norm, *inputs, backward=True, backend=STRICT)
    out = torch.compile(norm, backend=STRICT)(*inputs)
    eager = norm(*inputs)
    exact_inputs = [t.detach().double().requires_grad_() for t in inputs]
    exact = norm(*exact_inputs)
    dy = random_tensor(out.shape, torch.bfloat16)
    (dx,), (eager_dx,) = torch.autograd.grad(out, inputs[:1], dy), torch.autograd.grad(eager, inputs[:1], dy)
    (exact_dx,) = torch.autograd.grad(exact, exact_inputs[:1], dy.double())
    for got, want, true in ((out, eager, exact), (dx, eager_dx, exact_dx)):
        assert (got.double() - true).norm() <= 1.01 * (want.double() - true).norm()


def test_a_layer_norm_over_two_dims_stays_aten():
    x = random_tensor((3, 4, 6), torch.float32)
    report = check(lambda x: torch.nn.functional.layer_norm(x + 1, (4, 6)) * 2, x, backward=True, backend=STRICT)
    assert [n for n in report.graphs["forward"].graph.nodes if n.target == aten.native_layer_norm.default]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_backward_is_one_kernel(row_form, reduction):
    logits = random_tensor((2, 9, 41), torch.bfloat16)
    targets = torch.arange(18, device=DEVICE).view(2, 9) * 5 % 41
    targets[0, 3] = -100  # ignored: no gradient in its row

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)

    report = check(loss, logits, backward=True, backend=STRICT)
    (backward,) = rewrites(report, kind="reduction", phase="backward")
    assert {"aten.nll_loss_backward", "aten._log_softmax_backward_data"} <= set(backward.ops)
    assert not [n for n in report.graphs["backward"].graph.nodes if n.target == aten.nll_loss_backward.default]


def test_an_lm_heads_logits_gradient_is_cast_back_in_the_loss_backwards_kernel():
    """An LM head's logits, a matmul's viewed to (batch, time, vocab) and flattened again for an fp32 loss: the
    loss backward's gradient reaches the cast back to bf16 through a view splitting the rows and one merging them.
    The cast runs in the loss backward's kernel, which writes the bf16 gradient alone: no fp32 copy of the logits'
    gradient (the largest tensor of a language model's step)."""
    h = random_tensor((18, 16), torch.bfloat16).requires_grad_()
    w = random_tensor((16, 41), torch.bfloat16).requires_grad_()
    targets = torch.arange(18, device=DEVICE) * 5 % 41

    def loss(h, w):
        logits = (h @ w).view(2, 9, 41)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets)

    report = check(loss, h, w, backward=True, backend=STRICT)
    (backward,) = rewrites(report, kind="reduction", phase="backward")
    assert "aten._to_copy" in backward.ops
    graph = report.graphs["backward"].graph
    assert not [n for n in graph.nodes if n.target == aten._to_copy.default]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("upcast", [True, False], ids=["fp32 logits", "bf16 logits"])
def test_cross_entropy_forward_gathers_the_targets_and_walks_the_logits_alone(row_form, reduction, upcast):
    """The log-probabilities are never written: the forward keeps the logits and two row values (the backward
    recomputes them, bf16 ones too), and picks each target's logit by a gather from the logits as the graph holds
    them (its row walk reads the logits alone, no class index), for its row kernel to take its log-probability.
    An ignored target inside the classes too."""
    logits = random_tensor((3, 7, 45), torch.bfloat16)
    targets = torch.arange(21, device=DEVICE).view(3, 7) * 7 % 45
    targets[1, 2] = targets[2, 5] = 14  # the ignored class

    def loss(logits):
        x = logits.float() if upcast else logits
        return torch.nn.functional.cross_entropy(x.flatten(0, 1), targets.flatten(), reduction=reduction,
                                                 ignore_index=14) * 2

    report = check(loss, logits, backward=True, backend=STRICT)
    forward = report.graphs["forward"].graph
    assert not [n for n in forward.nodes if n.target in (aten.nll_loss_forward.default, aten._log_softmax.default)]
    assert not saved_full_size(report, (21, 45))
    (row,) = [r for r in rewrites(report, kind="reduction", phase="forward") if "aten.amax" in r.ops]
    assert row.bytes_fused < 2 * logits.numel() * logits.element_size()  # the logits read once
    assert "aten.eq" not in row.ops
    assert [n.target for n in forward.nodes if n.target in (aten.gather.default, aten.arange.start_step)] == \
        [aten.gather.default]
    (backward,) = rewrites(report, kind="reduction", phase="backward")
    assert {"aten.nll_loss_backward", "aten._log_softmax_backward_data"} <= set(backward.ops)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_of_flattened_logits_at_symbolic_rows_is_eager_s(row_form, reduction):
    """Rows of a symbolic count (a sequence's length, marked dynamic): the flattened logits are picked from where
    no view of theirs names the count (a view written by the pass would name it by value)."""
    def loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                                 reduction=reduction)

    for length in (9, 13):
        logits = random_tensor((2, length, 45), torch.bfloat16)
        targets = torch.arange(2 * length, device=DEVICE).view(2, length) * 7 % 45
        targets[0, 3] = -100
        torch._dynamo.mark_dynamic(logits, 1)
        torch._dynamo.mark_dynamic(targets, 1)
        check(loss, logits, targets, backward=True, backend=STRICT)


def test_cross_entropy_of_logits_a_kernel_computes_picks_the_target_in_its_row_walk(row_form):
    """Capped logits (Gemma 2's tanh), computed in the loss's own kernel: gathered from, they would have to be
    written out; the row walk takes each target's logit beside the row's maximum instead."""
    logits = random_tensor((21, 45), torch.bfloat16)
    targets = torch.arange(21, device=DEVICE) * 7 % 45

    def loss(logits):
        return torch.nn.functional.cross_entropy(torch.tanh(logits.float() / 3) * 3, targets)

    report = check(loss, logits, backward=True, backend=STRICT)
    forward = report.graphs["forward"].graph
    assert not [n for n in forward.nodes if n.target == aten.gather.default]
    (row,) = [r for r in rewrites(report, kind="reduction", phase="forward") if "aten.amax" in r.ops]
    assert "aten.eq" in row.ops and "aten.tanh" in row.ops


def test_an_inference_cross_entropy_writes_no_log_probabilities(row_form):
    """Without a gradient to compute the graph compiled is the inference graph, which no partition writes out: the
    loss is written out there too, and picks each row's target in its row kernel."""
    logits = random_tensor((21, 45), torch.bfloat16)
    targets = torch.arange(21, device=DEVICE) * 7 % 45

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits.float(), targets)

    report = check(loss, logits, backend=STRICT)
    assert "backward" not in report.graphs
    forward = report.graphs["forward"].graph
    assert not [n for n in forward.nodes if n.target in (aten.nll_loss_forward.default, aten._log_softmax.default)]
    (row,) = [r for r in rewrites(report, kind="reduction", phase="forward") if "aten.amax" in r.ops]
    assert row.bytes_fused < 2 * logits.numel() * logits.element_size()  # the logits read once


def test_a_log_sum_exp_by_hand_keeps_its_input_and_counts_the_maximum_in_its_kernel(row_form):
    """exp's and amax's saved results are detached in the joint graph: the partition sees through that and keeps
    the input and the row values; the maximum's backward counts its ties (a sum of bools) in the row kernel."""
    x = random_tensor((6, 37), torch.bfloat16)

    def lse(x):
        xf = x.float()
        m = xf.amax(-1, keepdim=True)
        return (m + torch.log(torch.exp(xf - m).sum(-1, keepdim=True))).squeeze(-1)

    report = check(lse, x, backward=True, backend=STRICT)
    assert not saved_full_size(report, (6, 37))
    (backward,) = rewrites(report, kind="reduction", phase="backward")
    assert "aten.eq" in backward.ops and backward.ops.count("aten.sum") == 2
    assert not [n for n in report.graphs["backward"].graph.nodes if n.target == aten.sum.dim_IntList]


def bias_gelu(x, bias):
    return torch.nn.functional.gelu(x + bias) * 2


@pytest.mark.parametrize("fn, shapes", [(residual_rmsnorm, [(3, 50, 45), (3, 50, 45), (45,)]),
                                        (layer_norm_by_hand, [(130, 37), (37,), (37,)]),
                                        (bias_gelu, [(2, 61, 29), (29,)])],
                         ids=["residual rmsnorm", "layer norm by hand", "bias and gelu"])
def test_weight_and_bias_gradients_are_summed_in_the_row_kernel(row_form, fn, shapes):
    """A gradient summed over every dim but the last (a norm's weight, a bias) is added up in the backward's row
    kernel, each program its rows (several steps of them here), the launcher their sums: no ATen sum left."""
    if row_form == "walked rows":  # no column sum in the kernel there, and each row a program of the interpreter's
        shapes = [(*[1] * (len(shape) - 2), 20, shape[-1]) if len(shape) > 1 else shape for shape in shapes]
    inputs = [random_tensor(shape, torch.bfloat16) for shape in shapes]
    report = check(fn, *inputs, backward=True, backend=STRICT)
    backward = report.graphs["backward"].graph
    summed = [n for n in backward.nodes if n.target == aten.sum.dim_IntList]
    assert not summed if row_form == "whole rows" else summed  # walked: rows past 16 are not held whole
    if row_form == "whole rows":
        assert not [h for h in report.hotspots if h.phase == "backward" and "aten.sum" in h.ops]


def linear_gelu(x, weight, bias):
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias))


def test_a_bias_gradient_of_merged_rows_is_summed_where_they_are_written():
    """A linear layer's bias gradient sums the gradient's rows through a view merging its leading dims: summed
    over those dims instead, it joins the GELU's backward that writes them, and no ATen sum is left."""
    x, weight, bias = (random_tensor(s, torch.float32) for s in ((3, 37, 29), (41, 29), (41,)))
    report = check(linear_gelu, x, weight, bias, backward=True, backend=STRICT)
    backward = report.graphs["backward"].graph
    assert not [n for n in backward.nodes if n.target == aten.sum.dim_IntList]
    (summed,) = rewrites(report, kind="reduction", phase="backward")
    assert "aten.gelu_backward" in summed.ops and "aten.sum" in summed.ops


def test_a_column_sum_is_read_by_another_kernel_and_a_wide_one_stays_aten():
    """A column sum is whole only after every program: its reader runs in a kernel of its own."""
    x = random_tensor((9, 21), torch.float32)
    report = check(lambda x: torch.sigmoid(x) * torch.sigmoid(x).sum(0) + 1, x, backward=True, backend=STRICT)
    assert len([r for r in report.rewrites if r.phase == "forward"]) == 2
    assert not [n for n in report.graphs["forward"].graph.nodes if n.target == aten.sum.dim_IntList]
    wide = random_tensor((3, reduction.PERSISTENT_MAX + 5), torch.float32)
    report = check(lambda x: (torch.sigmoid(x) * 2).sum(0, keepdim=True), wide, backend=STRICT)
    assert [n for n in report.graphs["forward"].graph.nodes if n.target == aten.sum.dim_IntList]


def test_a_column_sum_alone_runs_as_a_row_kernel_of_its_own():
    """A bias's gradient with nothing to fuse beside it (a linear layer's output read by a matmul) is a row kernel
    and its sums' total, which the GPU timed faster than ATen's sum (bench/NOTES.md); without `reductions` it is
    ATen's, and the report says why."""
    weight = random_tensor((40, 8), torch.float32).requires_grad_()
    linear = nn.Linear(24, 40).to(DEVICE)
    # the layer's weight and bias as inputs: their gradients (the bias's the sum) compared
    report = check(lambda x, w, b, m: torch.nn.functional.linear(x, w, b) @ m, random_tensor((3, 7, 24), torch.float32),
                   random_tensor((40, 24), torch.float32), random_tensor((40,), torch.float32), weight, backward=True,
                   backend=STRICT)
    (alone,) = [r for r in report.rewrites if r.phase == "backward"]
    assert (alone.kind, alone.ops) == ("reduction", ("aten.sum",))
    report = check(lambda x: linear(x) @ weight, random_tensor((3, 7, 24), torch.float32), backward=True,
                   backend=fusepass.backend(strict=True, reductions=False))
    assert not [r for r in report.rewrites if r.phase == "backward"]
    (left,) = [h for h in report.hotspots if h.phase == "backward" and h.ops == ("aten.sum",)]
    assert left.reason == "aten.sum over other dims than the last: an ATen reduction"


@pytest.mark.parametrize("dtype, shape, order", [
    (torch.float16, (3, 37, 24), None), (torch.bfloat16, (24, 5, 33), (2, 1, 0)),
    (torch.float64, (29, 40), None), (torch.float32, (0, 9), None)])
def test_a_column_sum_alone_in_each_dtype_and_layout(dtype, shape, order):
    """The lone sum's kernel over rows of each floating dtype, a transposed input and no rows at all (zeros)."""
    x = random_tensor(shape, dtype)
    x = x if order is None else x.permute(order)
    b, w = random_tensor(x.shape[-1:], dtype), random_tensor((x.shape[-1], 8), dtype)
    report = check(lambda x, b, w: (x + b) @ w, x, b, w, backward=True, backend=STRICT)
    assert [r.kind for r in report.rewrites if r.phase == "backward" and r.ops == ("aten.sum",)] == ["reduction"]


def test_a_cast_of_a_column_sum_outside_the_group_is_a_cast_of_what_it_reads():
    """The launcher rounds a column sum its group holds; one left to ATen is read as a value like any other."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(5, 7, 9, dtype=torch.float16)
    summed = graph.call_function(aten.sum.dim_IntList, (x, [0, 1], True))
    summed.meta["val"] = torch.empty(1, 1, 9, dtype=torch.float16)
    cast = graph.call_function(aten._to_copy.default, (summed,), {"dtype": torch.bfloat16})
    cast.meta["val"] = torch.empty(1, 1, 9, dtype=torch.bfloat16)
    assert reduction.column_sum_of(cast, {summed, cast}) is summed
    assert reduction.column_sum_of(cast, {cast}) is None


def test_a_column_sum_of_no_rows_is_zero():
    compiled = torch.compile(lambda x: ((x * 2 + 1).sum(0), torch.exp(x)), backend=STRICT, dynamic=False)
    x = random_tensor((0, 13), torch.float32)
    total, _ = compiled(x)
    torch.testing.assert_close(total, torch.zeros(13, device=x.device))


def test_a_column_sums_row_walk_in_stages(sources, monkeypatch):
    """Walked in pipeline stages (`COLUMN_STAGES`: Triton keeps later tiles' loads in flight) the sums (the weights'
    and biases' gradients, compared) are those of the walk as written, over row counts no program's share divides."""
    monkeypatch.setattr(row_kernel, "COLUMN_STAGES", 3)
    monkeypatch.setattr(row_kernel, "COLUMN_STAGE_BYTES", 1 << 20)  # three stages whatever the loads
    check(lambda x, w, b: torch.nn.functional.layer_norm(x, (40,), w, b), random_tensor((3, 37, 40), torch.float32),
          random_tensor((40,), torch.float32), random_tensor((40,), torch.float32), backward=True, backend=STRICT)
    check(lambda x, bias: torch.nn.functional.gelu(x + bias, approximate="tanh"),
          random_tensor((5, 19, 24), torch.float32), random_tensor((24,), torch.float32), backward=True, backend=STRICT)
    walks = [text for text in sources if "row_steps" in text]
    assert len(walks) == 2 and all("for rs in tl.range(0, row_steps, num_stages=3):" in text for text in walks)


def test_a_column_walks_stages_fit_its_shared_memory(monkeypatch):
    """A program holds the tiles it loads a row step (up to PERSISTENT_MAX elements each) once a stage in shared
    memory: fewer stages where they would pass COLUMN_STAGE_BYTES, down to the walk as written. A row's own values
    and the ones no row changes (loaded before the walk) take no stage's room."""
    from types import SimpleNamespace

    monkeypatch.setattr(row_kernel, "COLUMN_STAGES", 3)
    tile, row, weight = (True, True), (True, False), (False, True)
    program = SimpleNamespace(loads=[SimpleNamespace(dtype=torch.float32, by_value=False)] * 5, steps=[])
    dims = (tile, tile, tile, row, weight)  # 48 KiB a stage
    assert row_kernel.column_stages(program, dims) == 2
    assert row_kernel.column_stages(program, (tile, tile, row, row, weight)) == 3
    monkeypatch.setattr(row_kernel, "COLUMN_STAGE_BYTES", 1 << 20)
    assert row_kernel.column_stages(program, dims) == 3
    monkeypatch.setattr(row_kernel, "COLUMN_STAGE_BYTES", 1)
    assert row_kernel.column_stages(program, dims) == 1


def test_a_walk_holding_one_wide_row_takes_its_own_warps(sources, monkeypatch):
    """A column walk holding one row of 4096 or more (Gemma's 2304 in a 4096-wide tile) launches at
    COLUMN_WIDE_ROW_WARPS, its sums the same; a row kernel without column sums keeps `row_warps`."""
    from fusepass.runtime import launch

    monkeypatch.setattr(row_kernel, "COLUMN_WIDE_ROW_WARPS", 16)
    warps = {}
    made = launch.BoundLaunch.__init__

    def recording(self, kernel, n_args, **keywords):
        made(self, kernel, n_args, **keywords)
        warps[kernel.fn.__name__] = keywords["num_warps"]

    monkeypatch.setattr(launch.BoundLaunch, "__init__", recording)
    check(lambda x, weight: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight,
          random_tensor((3, 2304), torch.float32), random_tensor((2304,), torch.float32), backward=True,
          backend=STRICT)
    kernels = {re.findall(r"def (\w+)\(", text)[-1]: text for text in sources}
    (walk,) = [name for name, text in kernels.items() if "row_steps" in text]
    # The row kernels' warps alone (on a GPU the column sums' programs are added up by a kernel of their own)
    row_kernels = {name: n for name, n in warps.items() if name in kernels}
    assert row_kernels.pop(walk) == 16 and set(row_kernels.values()) == {8}


def test_a_column_walk_loads_what_no_row_changes_before_its_first_row(sources):
    """Gemma's RMSNorm backward: its weight (and 1 + weight) are loaded and computed once, ahead of the walk over
    the rows whose products with it the column sum adds up; the sums are the walk's as written."""
    def gemma_rmsnorm(x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())).to(x.dtype)

    check(gemma_rmsnorm, random_tensor((5, 13, 48), torch.float32), random_tensor((48,), torch.float32),
          backward=True, backend=STRICT)
    (walk,) = [text for text in sources if "row_steps" in text]
    head, rows = walk.split("for rs in ", 1)
    weight_load = re.compile(r"tl\.load\(l\d+_ptr \+ c2 \* l\d+_s2, mask=col_mask\)")
    assert weight_load.search(head) and " + 1.0)" in head
    assert not weight_load.search(rows) and " + 1.0)" not in rows


def test_class_weights_keep_cross_entropy_backward_aten():
    logits = random_tensor((7, 13), torch.float32)
    targets, weights = torch.arange(7, device=DEVICE) % 13, torch.rand(13, device=DEVICE) + 0.5
    report = check(lambda x: torch.nn.functional.cross_entropy(x, targets, weight=weights), logits, backward=True,
                   backend=STRICT)
    assert [n for n in report.graphs["forward"].graph.nodes if n.target == aten.nll_loss_forward.default]
    assert [n for n in report.graphs["backward"].graph.nodes if n.target == aten.nll_loss_backward.default]


def test_a_group_without_a_reduction_left_in_it(row_form):
    """nll_loss_backward beside pointwise ops only (the log-probabilities' gradient used as it is)."""
    logp = random_tensor((5, 23), torch.float32)
    targets = torch.arange(5, device=DEVICE) * 3 % 23

    def fn(logp):
        return torch.nn.functional.nll_loss(logp, targets) * 2

    report = check(fn, logp, backward=True, backend=STRICT)
    assert "aten.nll_loss_backward" in rewrites(report, kind="reduction", phase="backward")[0].ops


def test_a_layer_norm_over_a_symbolic_width_stays_aten_under_dynamic_sizes():
    """Its normalized shape is read off a symbolic size: a graph value, not a tensor (it failed the pass)."""
    compiled = torch.compile(lambda x: torch.nn.functional.layer_norm(x * 2, x.shape[-1:]) + 1, backend=STRICT,
                             dynamic=True)
    for width in (12, 19):
        x = random_tensor((3, width), torch.float32)
        torch.testing.assert_close(compiled(x), torch.nn.functional.layer_norm(x * 2, x.shape[-1:]) + 1)


@pytest.mark.parametrize("reductions", [True, False], ids=["fused", "aten reductions"])
def test_a_half_max_gradient_finds_its_maximum(reductions):
    """amax's gradient goes to the elements equal to the maximum: recomputed in the backward, a half-precision
    value must round at every op as eager's did, or no element equals the saved maximum (0 / 0: NaN)."""
    def row_max_shift(x):
        return x - x.amax(-1, keepdim=True)

    def fn(x, h):
        shifted = row_max_shift(row_max_shift(torch.asinh(h)))
        return shifted + x, torch.where(x > torch.digamma(h.abs() + 0.5), x, 0.5 * h)

    torch.manual_seed(0)
    x, h = random_tensor((5, 7, 9), torch.float32), random_tensor((5, 7, 9), torch.float16)
    check(fn, x, h, backward=True, backend=fusepass.backend(strict=True, reductions=reductions))
