"""Real model code: small random-initialised models from ``transformers`` with their eager attention.

Every attention block must be rewritten, and the logits and the gradients must be eager's.
"""
from __future__ import annotations

import pytest
import torch
from support import DEVICE

import fusepass

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 96, 2, 13
EAGER = {"attn_implementation": "eager"}  # the attention as the model's own code writes it


def gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, bos_token_id=0,
                                     eos_token_id=0, **EAGER)
    return transformers.GPT2LMHeadModel(config), 2


def bert():
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=VOCAB, **EAGER)
    return transformers.BertModel(config), 2


def llama():
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB, **EAGER)
    return transformers.LlamaForCausalLM(config), 2


def mistral():
    config = transformers.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, sliding_window=8,
                                        vocab_size=VOCAB, **EAGER)
    return transformers.MistralForCausalLM(config), 2


def bloom():
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB, **EAGER)
    return transformers.BloomForCausalLM(config), 2


def t5():
    config = transformers.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=VOCAB,
                                   decoder_start_token_id=0, **EAGER)
    return transformers.T5ForConditionalGeneration(config), 6  # encoder self, decoder self and cross


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "mistral": mistral, "bloom": bloom, "t5": t5}


def inputs(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=DEVICE)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long, device=DEVICE)
    mask[1, :4] = 0  # left padding in the second sequence
    batch = {"input_ids": ids, "attention_mask": mask}
    if name == "t5":
        batch["decoder_input_ids"] = ids[:, :7]
    return batch


def output(result) -> torch.Tensor:
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_attention_is_rewritten_and_exact(name):
    torch.manual_seed(0)
    model, attentions = MODELS[name]()
    model = model.to(DEVICE).eval()
    batch = inputs(name)
    fusepass.reset()
    expected = output(model(**batch))
    compiled = torch.compile(model, backend="fusepass")
    actual = output(compiled(**batch))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    rewritten = [r for report in fusepass.reports() for r in report.rewrites
                 if r.kind == "attention" and r.phase == "forward"]
    declined = [h for report in fusepass.reports() for h in report.hotspots if h.kind in ("attention", "fallback")]
    assert len(rewritten) == attentions, [(h.location, h.reason) for h in declined]
    assert not declined

    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()), grad, allow_unused=True)
    actual_grads = torch.autograd.grad(actual, list(model.parameters()), grad, allow_unused=True)
    for (param_name, _), e, a in zip(model.named_parameters(), expected_grads, actual_grads):
        if e is None:
            assert a is None or not a.any(), param_name
            continue
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=param_name)
