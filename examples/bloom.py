"""BLOOM as Hugging Face's ``modeling_bloom`` writes it (the 4.2x–4.3x releases, a boolean mask and
``masked_fill``): one fused ``query_key_value`` projection viewed as [B, T, H, 3, D] and split per head, heads
folded into the batch, ALiBi added through ``alibi.baddbmm(q, kᵀ, beta=1, alpha=1/sqrt(D))`` with the slopes of
``build_alibi_tensor`` times padding-aware positions (the attention mask's cumsum), a causal mask joined with the
padding mask and applied by ``masked_fill`` with ``torch.finfo(dtype).min``, the softmax in fp32 cast back,
LayerNorm on the embeddings and in every block, ``dropout_add`` residuals (p = 0), and the tanh GELU written out
as ``bloom_gelu_forward`` (BLOOM wraps it in an autograd.Function for training; here it is plain torch). An LM
head tied to the embedding gives logits over 32000 tokens (BLOOM's 250880 would dwarf the rest).

    python examples/bloom.py [--size tiny|small|medium] [--train] [--batch B] [--seq T]

small has bloom-560m's shape (24 layers, 1024 wide, 16 heads), medium bloom-1b7's (24, 2048, 16). The inputs pad
every other row on the left (BLOOM's tokenizer pads left) by a quarter of the sequence. Compares eager, Inductor
and fusepass on it (on a GPU in bf16, timed; without one at the tiny size through Triton's interpreter, checked
only) and prints fusepass's summary of what it fused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common import DEVICE, next_token_loss, run_model

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import LayerNorm


@dataclass(frozen=True)
class Config:
    n_layer: int
    hidden_size: int
    n_head: int
    vocab_size: int = 32000
    layer_norm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0


SIZES = {"tiny": Config(2, 32, 2, vocab_size=97), "small": Config(24, 1024, 16), "medium": Config(24, 2048, 16)}
BATCH = {"tiny": 2, "small": 4, "medium": 4}
SEQ = {"tiny": 23, "small": 1024, "medium": 1024}


def _make_causal_mask(input_ids_shape: torch.Size, device: torch.device,
                      past_key_values_length: int) -> torch.BoolTensor:
    """Make causal mask used for self-attention."""
    batch_size, target_length = input_ids_shape
    mask = torch.empty((target_length, target_length + past_key_values_length), dtype=torch.bool, device=device)
    # ONNX doesn't support `torch.Tensor.triu` properly, thus we use this workaround
    seq_ids = torch.arange(target_length, device=device)
    mask[:, past_key_values_length:] = seq_ids[:, None] < seq_ids[None, :]
    if past_key_values_length > 0:
        mask[:, :past_key_values_length] = False
    expanded_mask = mask[None, None, :, :].expand(batch_size, 1, target_length, target_length + past_key_values_length)
    return expanded_mask


def _expand_mask(mask: torch.Tensor, tgt_length: int) -> torch.BoolTensor:
    """Expands attention_mask from `[batch_size, src_length]` to `[batch_size, 1, tgt_length, src_length]`."""
    batch_size, src_length = mask.shape
    tgt_length = tgt_length if tgt_length is not None else src_length
    expanded_mask = ~(mask[:, None, None, :].to(torch.bool))
    return expanded_mask.expand(batch_size, 1, tgt_length, src_length)


def build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi as [batch_size * num_heads, 1, max_seq_len]: per-head slopes times each key's position among the
    row's real tokens (left padding shifts them)."""
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(
        2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float32
    )
    powers = torch.arange(1, 1 + closest_power_of_2, device=attention_mask.device, dtype=torch.int32)
    slopes = torch.pow(base, powers)

    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float32
        )
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, device=attention_mask.device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)

    # Note: alibi will added to the attention bias that will be applied to the query, key product of attention
    # => therefore alibi will have to be of shape (batch_size, num_heads, query_length, key_length)
    # => here we set (batch_size=1, num_heads=num_heads, query_length=1, key_length=max_length)
    # => the query_length dimension will then be broadcasted correctly
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    out = F.dropout(x, p=prob, training=training)
    return residual + out


def bloom_gelu_forward(x: torch.Tensor) -> torch.Tensor:
    """Custom bias GELU function. Adapted from Megatron-DeepSpeed code."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bloom_gelu_forward(x)


class BloomAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.hidden_dropout = config.hidden_dropout
        # Layer-wise attention scaling
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def _split_heads(self, fused_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[batch_size, seq_length, 3 x hidden_size] → 3 x [batch_size, seq_length, num_heads, head_dim], views."""
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        # batch_size * num_heads, seq_length, head_dim -> batch_size, seq_length, num_heads * head_dim
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]
        # 3 x [batch_size, seq_length, num_heads, head_dim]
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, q_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        key_layer = key_layer.permute(0, 2, 3, 1).reshape(batch_size * self.num_heads, self.head_dim, q_length)
        value_layer = value_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        _, _, kv_length = key_layer.shape

        # [batch_size * num_heads, q_length, kv_length]
        matmul_result = alibi.baddbmm(batch1=query_layer, batch2=key_layer, beta=self.beta, alpha=self.inv_norm_factor)

        # change view to [batch_size, num_heads, q_length, kv_length]
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, kv_length)

        # cast attention scores to fp32, compute scaled softmax and cast back to initial dtype
        input_dtype = attention_scores.dtype
        # `float16` has a minimum value of -65504.0, whereas `bfloat16` and `float32` have a minimum value of `-3.4e+38`
        if input_dtype == torch.float16:
            attention_scores = attention_scores.to(torch.float)
        attn_weights = torch.masked_fill(attention_scores, attention_mask, torch.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(input_dtype)
        attention_probs = self.attention_dropout(attention_probs)

        # change view [batch_size x num_heads, q_length, kv_length]
        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, kv_length)
        # matmul: [batch_size * num_heads, q_length, head_dim]
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        # change view [batch_size, q_length, num_heads * head_dim]
        context_layer = self._merge_heads(context_layer)

        output_tensor = self.dense(context_layer)
        return dropout_add(output_tensor, residual, self.hidden_dropout, self.training)


class BloomMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.dense_h_to_4h = nn.Linear(hidden_size, 4 * hidden_size)
        self.gelu_impl = BloomGelu()
        self.dense_4h_to_h = nn.Linear(4 * hidden_size, hidden_size)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden_states = self.gelu_impl(self.dense_h_to_4h(hidden_states))
        intermediate_output = self.dense_4h_to_h(hidden_states)
        return dropout_add(intermediate_output, residual, self.hidden_dropout, self.training)


class BloomBlock(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.input_layernorm = LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.num_heads = config.n_head
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = BloomMLP(config)

    def forward(self, hidden_states: torch.Tensor, alibi: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # hidden_states: [batch_size, seq_length, hidden_size]
        # Layer norm at the beginning of the transformer layer.
        layernorm_output = self.input_layernorm(hidden_states)
        residual = hidden_states  # apply_residual_connection_post_layernorm is False
        attention_output = self.self_attention(layernorm_output, residual, alibi=alibi, attention_mask=attention_mask)
        layernorm_output = self.post_attention_layernorm(attention_output)
        residual = attention_output
        return self.mlp(layernorm_output, residual)


class BloomForCausalLM(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.n_head
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.h = nn.ModuleList([BloomBlock(config) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.word_embeddings.weight  # tied

    def _prepare_attn_mask(self, attention_mask: torch.Tensor, input_shape: tuple[int, int],
                           past_key_values_length: int) -> torch.BoolTensor:
        # create causal mask
        # [batch_size, seq_length] -> [batch_size, 1, tgt_length, src_length]
        combined_attention_mask = None
        device = attention_mask.device
        _, src_length = input_shape
        if src_length > 1:
            combined_attention_mask = _make_causal_mask(input_shape, device=device,
                                                        past_key_values_length=past_key_values_length)
        # [batch_size, seq_length] -> [batch_size, 1, tgt_length, src_length]
        expanded_attn_mask = _expand_mask(attention_mask, tgt_length=src_length)
        combined_attention_mask = (
            expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask | combined_attention_mask
        )
        return combined_attention_mask

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.word_embeddings(input_ids)
        hidden_states = self.word_embeddings_layernorm(inputs_embeds)
        alibi = build_alibi_tensor(attention_mask, self.num_heads, dtype=hidden_states.dtype)
        causal_mask = self._prepare_attn_mask(attention_mask, input_shape=(batch_size, seq_length),
                                              past_key_values_length=0)
        for block in self.h:
            hidden_states = block(hidden_states, alibi=alibi, attention_mask=causal_mask)
        hidden_states = self.ln_f(hidden_states)
        return self.lm_head(hidden_states)


def inputs(model: BloomForCausalLM, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a padding mask: every other row's first quarter is (left) padding, mask 0."""
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=DEVICE)
    attention_mask = torch.ones(batch, seq, dtype=torch.long, device=DEVICE)
    attention_mask[1::2, :seq // 4] = 0
    return input_ids, attention_mask


def main(argv: list[str] | None = None):
    return run_model("BLOOM", lambda size, seq: BloomForCausalLM(SIZES[size]), inputs, next_token_loss,
                     SIZES, BATCH, SEQ, argv)


if __name__ == "__main__":
    main()
