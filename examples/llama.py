"""Llama as Meta's and Hugging Face's code writes it: RMSNorm upcast to float32, rotary embeddings (``rotate_half``,
cos/sin from ``inv_freq``), separate q/k/v projections, grouped-query heads repeated by ``repeat_kv`` (expand and
reshape), an additive causal mask built from ``arange``, scores ``matmul(q, k.transpose(2, 3)) / sqrt(head_dim)``
with the softmax in float32, a SwiGLU MLP of width ``int(8 · d / 3)`` (not a multiple of 64), an untied LM head.
``--window W`` makes it Mistral: a sliding window of W keys on top of the causal mask.

    python examples/llama.py [--size tiny|small|medium] [--train] [--batch B] [--seq T] [--window W]

Compares eager, Inductor and fusepass on it (on a GPU in bf16, timed; without one at the tiny size through
Triton's interpreter, checked only) and prints fusepass's summary of what it fused.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from common import DEVICE, next_token_loss, run_model

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    layers: int
    heads: int
    kv_heads: int
    width: int
    vocab: int = 32000
    head_dim: int | None = None  # Hugging Face's config.head_dim; width // heads where unset
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None  # Mistral

    @property
    def ffn(self) -> int:
        return int(8 * self.width / 3)


SIZES = {"tiny": Config(2, 4, 2, 32, vocab=97, head_dim=16), "small": Config(8, 16, 4, 2048),
         "medium": Config(4, 32, 8, 4096)}
BATCH = {"tiny": 2, "small": 1, "medium": 1}
SEQ = {"tiny": 29, "small": 8192, "medium": 4096}


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        dim = config.head_dim or config.width // config.heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()
        sin = emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, num_key_value_heads, seqlen, head_dim) → (batch, num_attention_heads, seqlen, head_dim)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def causal_mask(seq: int, dtype: torch.dtype, device: torch.device, sliding_window: int | None = None
                ) -> torch.Tensor:
    """Hugging Face's eager mask, [1, 1, T, T]: 0 where a query sees a key (``kv_idx <= q_idx``, and with a window
    ``kv_idx > q_idx - sliding_window``), the dtype's minimum elsewhere."""
    cache_position = torch.arange(seq, device=device)
    q_idx, kv_idx = cache_position[:, None], cache_position[None, :]
    allowed = kv_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (kv_idx > q_idx - sliding_window)
    min_dtype = torch.finfo(dtype).min
    return torch.where(allowed, torch.tensor(0.0, device=device, dtype=dtype), min_dtype)[None, None, :, :]


class LlamaAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.head_dim = config.head_dim or config.width // config.heads
        self.num_heads, self.num_key_value_heads = config.heads, config.kv_heads
        self.num_key_value_groups = config.heads // config.kv_heads
        self.q_proj = nn.Linear(config.width, config.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.width, config.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.width, config.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * self.head_dim, config.width, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim) \
            .transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim) \
            .transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class LlamaMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.width, config.ffn, bias=False)
        self.up_proj = nn.Linear(config.width, config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.width, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.width, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.width, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab, config.width)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.layers)])
        self.norm = LlamaRMSNorm(config.width, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        attention_mask = causal_mask(input_ids.shape[1], hidden_states.dtype, input_ids.device,
                                     self.config.sliding_window)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_embeddings, attention_mask)
        return self.lm_head(self.norm(hidden_states))


def inputs(model: LlamaForCausalLM, batch: int, seq: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, model.config.vocab, (batch, seq), device=DEVICE),)


def main(argv: list[str] | None = None):
    # --window W on top of the runner's options: Mistral, a sliding window of W keys.
    window_parser = argparse.ArgumentParser(add_help=False)
    window_parser.add_argument("--window", type=int)
    window, argv = window_parser.parse_known_args(argv)
    name = "Llama" if window.window is None else f"Mistral (Llama, sliding window {window.window})"
    return run_model(name, lambda size, seq: LlamaForCausalLM(replace(SIZES[size], sliding_window=window.window)),
                     inputs, next_token_loss, SIZES, BATCH, SEQ, argv)


if __name__ == "__main__":
    main()
