"""The example models (examples/*.py) at their tiny size, on this machine: each one's logits and every parameter's
gradient are eager's under fusepass (the examples' own runner raises where they are not), and its attention is
rewritten, forward and backward."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from support import DEVICE

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
MODELS = ["gpt2", "bert", "bloom", "llama", "t5", "gemma2", "vit"]


def _example(name: str):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # the examples import their runner, examples/common.py
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", MODELS)
def test_example_model_matches_eager(name):
    if not os.path.exists(os.path.join(EXAMPLES, f"{name}.py")):
        pytest.skip(f"examples/{name}.py not written yet")
    result = _example(name).main(["--size", "tiny"])
    fused = result.result("fusepass")
    assert not fused.missing_gradients
    kinds = {(r.kind, r.phase) for report in result.reports for r in report.rewrites}
    assert {("attention", "forward"), ("attention", "backward")} <= kinds, kinds


def test_an_example_trains_with_its_loss_compiled():
    """`--loss-compiled` (bench/models.py's row of it): the loss in the compiled function, its gradients eager's."""
    result = _example("gpt2").main(["--size", "tiny", "--loss-compiled", "--train"])  # (a GPU's run times the step)
    assert not result.result("fusepass").missing_gradients
    kinds = {(r.kind, r.phase) for report in result.reports for r in report.rewrites}
    assert ("reduction", "backward") in kinds  # the loss's backward, fused


# Each example's model at its tiny size, and its loss, for the sequence models.
BUILT = {
    "gpt2": ("GPT", "next_token_loss"), "llama": ("LlamaForCausalLM", "next_token_loss"),
    "bert": ("BertModel", "readout_loss"), "t5": ("T5ForConditionalGeneration", "next_token_loss"),
    "bloom": ("BloomForCausalLM", "next_token_loss"), "gemma2": ("Gemma2ForCausalLM", "next_token_loss"),
}


@pytest.mark.parametrize("name", sorted(BUILT))
def test_example_model_trains_at_new_lengths(name):
    """Trained at one length, then at two more (Dynamo recompiles with symbolic sizes, and the attention is planned
    at each): every parameter's gradient is eager's at each length, and the attention stays fused. T5's shared
    position bias reached its planned attention as a permuted tensor, whose gradient was added up in the wrong
    places; BLOOM's ALiBi baddbmm had no fake value under symbolic sizes."""
    import torch

    import fusepass

    example = _example(name)
    model_class, loss_name = BUILT[name]
    torch.manual_seed(0)
    model = getattr(example, model_class)(example.SIZES["tiny"]).to(DEVICE)  # where the example's inputs are
    loss = getattr(example, loss_name)
    fusepass.reset()
    compiled = torch.compile(model, backend=fusepass.backend(strict=True))
    for seq in (17, 29, 23):
        inputs = example.inputs(model, 2, seq)
        model.zero_grad(set_to_none=True)
        loss(model(*inputs)).backward()
        expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        loss(compiled(*inputs)).backward()
        actual = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert actual.keys() == expected.keys()
        # against the largest gradient: some are zero but for rounding (a key bias shifts a row's scores alike)
        scale = max(grad.abs().max().item() for grad in expected.values())
        for n, grad in expected.items():
            torch.testing.assert_close(actual[n], grad, rtol=1e-3, atol=1e-5 * scale, msg=n)
    kinds = {(r.kind, r.phase) for report in fusepass.reports() for r in report.rewrites}
    assert {("attention", "forward"), ("attention", "backward")} <= kinds
    assert not [h for report in fusepass.reports() for h in report.hotspots if h.kind == "attention"]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_padded_product_s_gradient_operand_is_written_padded(name, monkeypatch):
    """Every matmul padded, as a GPU that times the padded form faster pads it, the loss compiled with the model (as
    nanoGPT's forward computes it): GPT-2's logits gradient (2 × 17 rows of its vocabulary of 97) is written padded
    by the loss backward's kernel for the LM head's two products, Llama's SwiGLU gradients (an FFN of int(8 · d / 3))
    by theirs; every parameter's gradient is eager's."""
    import torch

    import fusepass
    from fusepass.matmul import pad

    monkeypatch.setattr(pad, "_padding", lambda node, a, b: tuple(pad._aligned(d, torch.float16) - d for d in
                                                                   (a.shape[-2], a.shape[-1], b.shape[-1])) or None)
    monkeypatch.setattr(pad, "_measured", lambda *args: (1.0, 0.5))
    example = _example(name)
    model_class, loss_name = BUILT[name]
    torch.manual_seed(0)
    model = getattr(example, model_class)(example.SIZES["tiny"]).to(DEVICE)
    loss = getattr(example, loss_name)
    inputs = example.inputs(model, 2, 17)
    loss(model(*inputs)).backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    fusepass.reset()
    torch.compile(lambda *inputs: loss(model(*inputs)), backend=fusepass.backend(strict=True))(*inputs).backward()
    actual = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert actual.keys() == expected.keys()
    scale = max(grad.abs().max().item() for grad in expected.values())
    for n, grad in expected.items():
        torch.testing.assert_close(actual[n], grad, rtol=1e-3, atol=1e-5 * scale, msg=n)
    written = [text for report in fusepass.reports() for r in report.rewrites if r.phase == "backward"
               for text in r.detail.get("written padded", ())]
    assert written
    if name == "gpt2":
        assert "[40, 104] for a matmul (+6 rows, +7 columns)" in written
