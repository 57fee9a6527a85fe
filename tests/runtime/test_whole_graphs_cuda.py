"""Whole-graph replays on the GPU (`graphs=True`, runtime/whole_graphs.py): the example models trained with their
graphs replayed by torch's CUDA graph trees give, step after step, what the same compiled graphs give run as
compiled (fusepass without the SDPA floor, which replays turn off): the batch in new memory each step, the weights
updated in place between steps, a second batch size and back. Graphs that cannot be replayed run as compiled and
the report says why. Random draws, ATen's and attention dropout's, replay new numbers each step."""
from __future__ import annotations

import copy

import pytest
import torch
from models.test_examples import BUILT, _example

import fusepass

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

# The examples whose graphs replay whole (GPT-2's attention computes its `tril` buffer, checked before each replay;
# Gemma 2's normalizer, `torch.tensor(width ** 0.5)`, is made on the device: runtime/host_scalars.py).
REPLAYED = ["bert", "t5", "llama", "bloom", "gpt2", "gemma2"]


@pytest.fixture(autouse=True)
def _fresh_trees():
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    yield
    reset_cudagraph_trees()


def _recorded_graphs() -> int:
    """The graphs the trees recorded: their roots (a forward, an inference) and what follows them (a backward)."""
    from torch._inductor.cudagraph_trees import get_manager

    def count(nodes) -> int:
        return sum(1 + count([c for children in n.children.values() for c in children]) for n in nodes)

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else count(list(manager.get_roots()))


def _not_replayed() -> list[str]:
    return [n for report in fusepass.reports() for n in report.notices if "not replayed whole" in n]


def _train_side_by_side(name: str, dtype: torch.dtype, batches: list[int], seq: int = 29) -> None:
    """`name`'s model trained with SGD, its graphs replayed whole beside run as compiled: the losses and every
    gradient agree at each step."""
    example = _example(name)
    model_class, loss_name = BUILT[name]
    torch.manual_seed(0)
    model = getattr(example, model_class)(example.SIZES["tiny"]).to("cuda", dtype)
    twin = copy.deepcopy(model)
    loss = getattr(example, loss_name)
    fusepass.reset()
    replayed = torch.compile(model, backend=fusepass.backend(graphs=True, strict=True), dynamic=False)
    compiled = torch.compile(twin, backend=fusepass.backend(graphs=False, sdpa=False, strict=True), dynamic=False)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, twin)]
    steps = []
    for batch in batches:
        inputs = example.inputs(model, batch, seq)
        results = []
        for m, run, optimizer in zip((model, twin), (replayed, compiled), optimizers):
            optimizer.zero_grad(set_to_none=True)
            value = loss(run(*inputs))
            value.backward()
            # kept past the next steps as they are: what a replay hands out is the caller's
            results.append((value.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
            optimizer.step()
        steps.append(results)
    for step, ((value, grads), (expected_value, expected_grads)) in enumerate(steps):
        assert grads.keys() == expected_grads.keys()
        torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        scale = max(g.abs().max().item() for g in expected_grads.values())
        for n, grad in expected_grads.items():
            torch.testing.assert_close(grads[n], grad, rtol=1e-4, atol=1e-5 * scale, msg=f"step {step}: {n}")


def _beside_compiled(model: torch.nn.Module, dynamic: bool = False) -> tuple:
    """A copy of `model`, and the two compiled: `model` with its graphs replayed whole, the copy run as compiled."""
    twin = copy.deepcopy(model)
    fusepass.reset()
    replayed = torch.compile(model, backend=fusepass.backend(graphs=True, strict=True), dynamic=dynamic)
    compiled = torch.compile(twin, backend=fusepass.backend(graphs=False, strict=True), dynamic=dynamic)
    return twin, replayed, compiled


@pytest.mark.parametrize("name", REPLAYED)
def test_a_model_trained_with_its_graphs_replayed_is_trained_as_compiled(name):
    _train_side_by_side(name, torch.float32, [2, 2, 2, 2, 3, 3, 3, 2, 2])
    assert not _not_replayed()
    assert _recorded_graphs() >= 2  # a forward and its backward at least, per batch size


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_bf16_training_with_its_graphs_replayed_is_trained_as_compiled(name):
    _train_side_by_side(name, torch.bfloat16, [2, 2, 2, 2])
    assert not _not_replayed()


def test_a_graph_that_reads_the_callers_host_tensor_runs_as_compiled_and_says_why():
    """A 0-d tensor the caller passes on the host may change between calls (a temperature): it stays there, and
    the graph is not replayed. Its own constants on the host are made on the device: those graphs replay."""
    linear = torch.nn.Linear(16, 16).cuda()

    def scaled(x, temperature):
        return torch.softmax(linear(x) * torch.tensor(0.5) / temperature, dim=-1)

    fusepass.reset()
    replayed = torch.compile(scaled, backend=fusepass.backend(graphs=True, strict=True), dynamic=False)
    for t in (1.0, 2.0, 3.0):
        x = torch.randn(4, 16, device="cuda", requires_grad=True)
        out = replayed(x, torch.tensor(t))
        torch.testing.assert_close(out, scaled(x, torch.tensor(t)))
        out.sum().backward()
    notices = _not_replayed()
    assert notices and all("is a tensor on the CPU, which a CUDA graph does not hold" in n for n in notices), notices


def test_inference_replayed_whole_is_inference_as_compiled():
    example = _example("bert")
    torch.manual_seed(0)
    model = example.BertModel(example.SIZES["tiny"]).to("cuda").eval()
    fusepass.reset()
    replayed = torch.compile(model, backend=fusepass.backend(graphs=True, strict=True))
    outputs = []
    with torch.no_grad():
        for _ in range(4):
            inputs = example.inputs(model, 2, 29)
            outputs.append((replayed(*inputs).clone(), model(*inputs)))
    for out, expected in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert _recorded_graphs() >= 1 and not _not_replayed()


def test_parameters_are_read_where_they_lie_not_copied_before_each_replay():
    """The trees copy each argument they do not hold static into the recording's buffers before every replay
    (and keep a second copy in the pool): a graph's parameters and buffers are static, as AOTAutograd marks them
    where Dynamo's input sources reach it through fusepass's retraced graph."""
    from torch._inductor.cudagraph_trees import get_manager

    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96)).cuda()
    fusepass.reset()
    replayed = torch.compile(model, backend=fusepass.backend(graphs=True, strict=True), dynamic=False)
    for _ in range(3):
        replayed(torch.randn(8, 64, device="cuda")).sum().backward()
    (root,) = get_manager(torch.cuda.current_device(), create_if_none_exists=False).get_roots()
    static = {root.static_input_data_ptrs[i] for i in root.static_input_idxs}
    assert {p.data_ptr() for p in model.parameters()} <= static and not _not_replayed()


def test_buffers_written_in_place_by_a_replayed_graph_are_written_as_compiled():
    """BatchNorm's running statistics, buffers its training forward writes in place: static arguments (they stay
    where they are), so the graph replays and writes them there; step after step they and the gradients are those
    of the same model run as compiled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.BatchNorm1d(40), torch.nn.Tanh()).cuda()
    twin, replayed, compiled = _beside_compiled(model)
    for step in range(5):
        x = torch.randn(16, 24, device="cuda")
        for m, run in ((model, replayed), (twin, compiled)):
            m.zero_grad(set_to_none=True)
            run(x).pow(2).sum().backward()
        for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name}, step {step}")
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert _recorded_graphs() >= 2 and not _not_replayed()


def test_gradients_are_lent_copied_only_where_kept_and_readable_after_the_trees_are_reset(monkeypatch):
    """A replay's gradients are lent out of the trees' pool: a loop that sets them to None before the next forward
    copies nothing; gradients accumulated over steps get memory of their own once, at the next forward, and add up
    as compiled; kept when the trees are reset, they still read their values (the pool is held while they may live).
    Two batch sizes, each compiled apart."""
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    from fusepass.runtime import lent_outputs

    monkeypatch.setattr(lent_outputs, "LEND_GRADIENTS", True)
    moved = []
    move = lent_outputs._move
    monkeypatch.setattr(lent_outputs, "_move", lambda grad: moved.append(grad.shape) or move(grad))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96)).cuda()
    twin, replayed, compiled = _beside_compiled(model)
    # a second batch size in each phase: a compile of its own, whose gradients are lent and moved alike
    batches = [torch.randn(rows, 64, device="cuda") for rows in (8, 8, 5, 8, 5, 8)]
    weights = torch.randn(96, device="cuda")
    for x in batches[:3]:
        model.zero_grad(set_to_none=True)
        (replayed(x) * weights).sum().backward()
    assert moved == [] and _recorded_graphs() >= 2 and not _not_replayed()
    for m, run in ((model, replayed), (twin, compiled)):
        m.zero_grad(set_to_none=True)
        for x in batches[3:]:  # accumulated, as over micro-batches
            (run(x) * weights).sum().backward()
    # each kept gradient once, at the next forward; the later backwards add theirs into its own memory
    assert len(moved) == len(list(model.parameters()))
    for grad, expected in zip((p.grad for p in model.parameters()), (p.grad for p in twin.parameters())):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    for m, run in ((model, replayed), (twin, compiled)):
        m.zero_grad(set_to_none=True)
        (run(batches[0]) * weights).sum().backward()
    kept = [p.grad for p in model.parameters()]  # lent: the pool's memory
    reset_cudagraph_trees()
    torch.cuda.empty_cache()
    scratch = torch.full((1 << 24,), float("nan"), device="cuda")  # memory given back would be written here
    for grad, expected in zip(kept, (p.grad for p in twin.parameters())):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    del scratch


def test_a_model_fed_more_sizes_than_are_recorded_trains_as_compiled_past_them():
    """Under symbolic sizes each batch size is recorded apart; past `SIZES_RECORDED` the compile runs as compiled,
    forward and backward, with one warning, and every step's gradients stay those of the same graphs run as
    compiled."""
    from fusepass.runtime import whole_graphs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.LayerNorm(48)).cuda()
    twin, replayed, compiled = _beside_compiled(model, dynamic=True)
    sizes = list(range(3, 3 + whole_graphs.SIZES_RECORDED + 2)) + [3]
    with pytest.warns(RuntimeWarning, match="runs as compiled from now on") as caught:
        for rows in sizes:
            x = torch.randn(rows, 32, device="cuda")
            for m, run in ((model, replayed), (twin, compiled)):
                m.zero_grad(set_to_none=True)
                run(x).pow(2).sum().backward()
            for a, b in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=f"{rows} rows")
    assert len([w for w in caught if "sets of sizes" in str(w.message)]) == 1
    assert any("recorded at" in n for n in _not_replayed())


class DropoutBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.nn.functional.gelu(self.linear(x)), p=0.5, training=True)


def test_aten_random_draws_are_new_in_each_replay():
    fusepass.reset()  # no earlier test's notices in the reports read below
    torch.manual_seed(0)
    model = DropoutBlock().cuda()
    replayed = torch.compile(model, backend=fusepass.backend(graphs=True, strict=True))
    x = torch.randn(8, 64, device="cuda")
    outputs, bias_grads = [], []
    for _ in range(5):  # the gradients accumulate over the steps, as over micro-batches
        out = replayed(x)
        out.sum().backward()
        outputs.append(out)
        bias_grads.append(model.linear.bias.grad.clone())
    assert _recorded_graphs() >= 2 and not _not_replayed()
    masks = [out != 0 for out in outputs]
    assert all(not torch.equal(masks[i], masks[i + 1]) for i in range(4))
    assert all(0.4 < m.float().mean().item() < 0.6 for m in masks)
    # each step's bias gradient is its kept mask's (dropout scales what it keeps by 2) times GELU's slope
    pre = model.linear(x).detach().requires_grad_()
    slope, = torch.autograd.grad(torch.nn.functional.gelu(pre).sum(), pre)
    expected = torch.cumsum(torch.stack([(2 * m * slope).sum(0) for m in masks]), 0)
    torch.testing.assert_close(torch.stack(bias_grads), expected, rtol=1e-5, atol=1e-5)


def test_attention_dropout_replays_with_new_draws_that_its_backward_keeps():
    """Attention dropout's seed is drawn on the device, so each replay drops other weights, and the replayed
    backward drops the forward's: with V the identity the output is each kept weight (scaled by 1 / (1 - p)) and 0
    where dropped, and every gradient matches float64's computed with that mask."""
    from attention.test_attention import dropout_attention

    torch.manual_seed(0)
    n, p = 40, 0.25
    q, k = (torch.randn(1, 2, n, n, device="cuda") for _ in range(2))
    identity = torch.eye(n, device="cuda").expand(1, 2, n, n)
    fusepass.reset()
    replayed = torch.compile(dropout_attention, backend=fusepass.backend(graphs=True, strict=True))
    masks = []
    for _ in range(4):
        leaves = [x.clone().requires_grad_() for x in (q, k, identity)]
        out = replayed(*leaves)
        grad = torch.randn_like(out)
        out.backward(grad)
        kept = out.detach() != 0
        wide = [x.detach().double().requires_grad_() for x in leaves]
        weights = torch.softmax(wide[0] @ wide[1].transpose(-1, -2) / n ** 0.5, dim=-1)
        expected = (weights * kept / (1 - p)) @ wide[2]
        expected.backward(grad.double())
        torch.testing.assert_close(out.detach().double(), expected.detach(), rtol=1e-5, atol=1e-5)
        for leaf, reference in zip(leaves, wide):
            torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=1e-4, atol=1e-4)
        masks.append(kept)
    assert 0.65 < torch.stack(masks).float().mean().item() < 0.85
    assert not any(torch.equal(a, b) for a, b in zip(masks, masks[1:]))
    assert _recorded_graphs() >= 2 and not _not_replayed()


def test_a_buffer_mask_written_in_place_ends_the_replays():
    """nanoGPT's `tril` buffer, computed from the positions by the replayed kernels, written in place between steps:
    the next step checks it before replaying, runs as compiled and reads the buffer (eager's result)."""
    from attention.test_known_contents import BufferAttention

    torch.manual_seed(0)
    model = BufferAttention().cuda()
    twin = copy.deepcopy(model)
    fusepass.reset()
    replayed = torch.compile(model, backend=fusepass.backend(graphs=True))
    for step in range(6):
        if step == 4:
            with torch.no_grad():
                for m in (model, twin):
                    m.bias[..., 5, 9] = 1.0  # one key past the diagonal seen
        x = torch.randn(2, 37, 32, device="cuda")
        for m, run in ((model, replayed), (twin, twin)):
            m.zero_grad(set_to_none=True)
            run(x).pow(2).sum().backward()
        for p, expected in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, expected.grad, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    assert _recorded_graphs() >= 2
    notices = _not_replayed()
    assert len(notices) == 1 and "from this call on: L['self']._buffers['bias'] no longer holds" in notices[0]
