"""Gemma 2 as Google's and Hugging Face's code writes it: local layers (a sliding window of 4096 keys on top of the
causal mask) alternating with global ones (causal), grouped-query heads repeated by ``repeat_kv``, queries scaled
by ``query_pre_attn_scalar ** -0.5``, the scores soft-capped (``tanh(scores / 50) · 50``) before the mask and a
float32 softmax, Gemma's RMSNorm (``(1 + weight) · normed``, in float32) before and after both the attention and
the MLP, rotary embeddings, a GeGLU MLP (GELU, tanh), the embedding scaled by ``sqrt(width)`` and tied to the LM
head, whose logits are soft-capped at 30.

    python examples/gemma2.py [--size tiny|small|medium] [--train] [--batch B] [--seq T]

Compares eager, Inductor and fusepass on it (on a GPU in bf16, timed; without one at the tiny size through
Triton's interpreter, checked only) and prints fusepass's summary of what it fused.
"""
from __future__ import annotations

from dataclasses import dataclass

from common import DEVICE, next_token_loss, run_model
# Gemma 2's rotary embedding, repeat_kv and eager masks are Llama's (Hugging Face's modeling file copies them).
from llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, causal_mask, repeat_kv

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    layers: int  # even layers local (sliding window), odd ones global
    heads: int
    kv_heads: int
    width: int
    head_dim: int
    ffn: int
    vocab: int = 32000
    sliding_window: int = 4096
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float = 50.0
    final_logit_softcapping: float = 30.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


SIZES = {"tiny": Config(2, 4, 2, 32, 16, 128, vocab=97, sliding_window=8, query_pre_attn_scalar=16),
         "small": Config(4, 8, 4, 2304, 256, 9216), "medium": Config(8, 16, 8, 3584, 256, 14336)}
BATCH = {"tiny": 2, "small": 1, "medium": 1}
SEQ = {"tiny": 29, "small": 8192, "medium": 8192}


class Gemma2RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float())
        # Llama does x.to(float16) * w whilst Gemma2 is (x * w).to(float16)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Gemma2Attention(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_key_value_heads = config.heads, config.kv_heads
        self.num_key_value_groups = config.heads // config.kv_heads
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.attn_logit_softcapping = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if not bool(layer_idx % 2) else None
        self.q_proj = nn.Linear(config.width, config.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.width, config.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.width, config.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * self.head_dim, config.width, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        # eager_attention_forward
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if self.attn_logit_softcapping is not None:
            attn_weights = attn_weights / self.attn_logit_softcapping
            attn_weights = torch.tanh(attn_weights)
            attn_weights = attn_weights * self.attn_logit_softcapping
        causal = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class Gemma2MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.width, config.ffn, bias=False)
        self.up_proj = nn.Linear(config.width, config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.width, bias=False)
        self.act_fn = nn.GELU(approximate="tanh")  # gelu_pytorch_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.is_sliding = not bool(layer_idx % 2)
        self.self_attn = Gemma2Attention(config, layer_idx)
        self.mlp = Gemma2MLP(config)
        self.input_layernorm = Gemma2RMSNorm(config.width, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Gemma2RMSNorm(config.width, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(config.width, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma2RMSNorm(config.width, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + hidden_states


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab, config.width)
        self.layers = nn.ModuleList([Gemma2DecoderLayer(config, i) for i in range(config.layers)])
        self.norm = Gemma2RMSNorm(config.width, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        cache_position = torch.arange(seq, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        mask_mapping = {
            "full_attention": causal_mask(seq, hidden_states.dtype, input_ids.device),
            "sliding_attention": causal_mask(seq, hidden_states.dtype, input_ids.device, self.config.sliding_window),
        }
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        # normalized: Gemma2 downcasts the below to the embedding's dtype
        normalizer = torch.tensor(self.config.width**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer
        for decoder_layer in self.layers:
            mask = mask_mapping["sliding_attention" if decoder_layer.is_sliding else "full_attention"]
            hidden_states = decoder_layer(hidden_states, position_embeddings, mask)
        hidden_states = self.norm(hidden_states)

        logits = self.lm_head(hidden_states)
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        return logits


def inputs(model: Gemma2ForCausalLM, batch: int, seq: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, model.config.vocab, (batch, seq), device=DEVICE),)


def main(argv: list[str] | None = None):
    return run_model("Gemma 2", lambda size, seq: Gemma2ForCausalLM(SIZES[size]), inputs, next_token_loss, SIZES, BATCH,
                     SEQ, argv)


if __name__ == "__main__":
    main()
