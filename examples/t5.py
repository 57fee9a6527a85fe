"""T5 (v1.0, T5-base and T5-large shaped) as Google's and Hugging Face's code writes it: an encoder–decoder with
T5LayerNorm (a root mean square, no mean subtracted, the variance in float32), scores ``matmul(q, k.transpose(3,
2))`` left unscaled (T5 folds the 1/sqrt(d) into its init, written here as ``_init_weights``), the bucketed relative
position bias of ``_relative_position_bucket`` gathered from a learnable [num_buckets, heads] table by the first
layer of each stack and added to every layer's scores (bidirectional in the encoder, causal in the decoder, where
the causal mask is folded into the bias), cross-attention from the decoder to the encoder's outputs with a zero
bias, a ReLU FFN, one embedding shared by both stacks and tied to the LM head (its input scaled by d^-0.5).
Every sequence is full length: no padding masks; no dropout.

    python examples/t5.py [--size tiny|small|medium] [--train] [--batch B] [--seq T]

Compares eager, Inductor and fusepass on it (on a GPU in bf16, timed; without one at the tiny size through
Triton's interpreter, checked only) and prints fusepass's summary of what it fused. ``--seq`` sets the encoder's
length; the decoder's is the size's own (11 at tiny) or, where it has none, the encoder's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common import DEVICE, next_token_loss, run_model

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    layers: int  # in each of the encoder and the decoder
    heads: int
    width: int  # d_model
    ff: int  # d_ff
    d_kv: int = 64
    vocab: int = 32128
    num_buckets: int = 32
    max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    decoder_seq: int | None = None  # the decoder's length (None: the encoder's)


SIZES = {"tiny": Config(2, 2, 32, 64, d_kv=16, vocab=97, num_buckets=8, max_distance=16, decoder_seq=11),
         "small": Config(12, 12, 768, 3072), "medium": Config(24, 16, 1024, 4096)}
BATCH = {"tiny": 2, "small": 8, "medium": 4}
SEQ = {"tiny": 17, "small": 512, "medium": 512}


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        """Construct a layernorm module in the T5 style. No bias and no subtraction of mean."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # T5 uses a layer_norm which only scales and doesn't shift (Root Mean Square Layer Normalization): the
        # variance is computed without the mean, in fp32 whatever the input's dtype.
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        # convert into half-precision if necessary
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class T5DenseActDense(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.wi = nn.Linear(config.width, config.ff, bias=False)
        self.wo = nn.Linear(config.ff, config.width, bias=False)
        self.act = nn.ReLU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wi(hidden_states)
        hidden_states = self.act(hidden_states)
        if hidden_states.dtype != self.wo.weight.dtype:
            hidden_states = hidden_states.to(self.wo.weight.dtype)
        return self.wo(hidden_states)


class T5LayerFF(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.DenseReluDense = T5DenseActDense(config)
        self.layer_norm = T5LayerNorm(config.width, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        forwarded_states = self.layer_norm(hidden_states)
        forwarded_states = self.DenseReluDense(forwarded_states)
        return hidden_states + forwarded_states


class T5Attention(nn.Module):
    def __init__(self, config: Config, is_decoder: bool, has_relative_attention_bias: bool = False) -> None:
        super().__init__()
        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = config.num_buckets
        self.relative_attention_max_distance = config.max_distance
        self.d_model = config.width
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.heads
        self.inner_dim = self.n_heads * self.key_value_proj_dim

        # Mesh TensorFlow initialization to avoid scaling before softmax
        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32,
                                  max_distance: int = 128) -> torch.Tensor:
        """Translate relative position to a bucket number for relative attention (Mesh TensorFlow's): half the
        buckets for exact increments in positions, the other half for logarithmically bigger bins up to
        max_distance; with `bidirectional` the buckets split between positive and negative distances."""
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        # now relative_position is in the range [0, inf)

        # half of the buckets are for exact increments in positions
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact

        # The other half of the buckets are for logarithmically bigger bins in positions up to max_distance
        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
        )

        relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
        return relative_buckets

    def compute_bias(self, query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
        """Compute binned relative position bias"""
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position  # shape (query_length, key_length)
        relative_position_bucket = self._relative_position_bucket(
            relative_position,  # shape (query_length, key_length)
            bidirectional=(not self.is_decoder),
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        values = self.relative_attention_bias(relative_position_bucket)  # shape (query_length, key_length, heads)
        values = values.permute([2, 0, 1]).unsqueeze(0)  # shape (1, num_heads, query_length, key_length)
        return values

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None,
                key_value_states: torch.Tensor | None = None, position_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention (key_value_states None) or attention over the encoder's outputs (key_value_states)."""
        batch_size, seq_length = hidden_states.shape[:2]
        is_cross_attention = key_value_states is not None

        query_states = self.q(hidden_states)
        query_states = query_states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        current_states = key_value_states if is_cross_attention else hidden_states
        key_states = self.k(current_states)
        value_states = self.v(current_states)
        key_states = key_states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        value_states = value_states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        # compute scores, equivalent of torch.einsum("bnqd,bnkd->bnqk", query_states, key_states)
        scores = torch.matmul(query_states, key_states.transpose(3, 2))

        if position_bias is None:
            key_length = key_states.shape[-2]
            if not self.has_relative_attention_bias:
                position_bias = torch.zeros(
                    (1, self.n_heads, seq_length, key_length), device=scores.device, dtype=scores.dtype
                )
            else:
                position_bias = self.compute_bias(seq_length, key_length, device=scores.device)
            if mask is not None:
                causal_mask = mask[:, :, :, : key_states.shape[-2]]
                position_bias = position_bias + causal_mask

        scores += position_bias
        # (batch_size, n_heads, seq_length, key_length)
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.view(batch_size, -1, self.inner_dim)
        attn_output = self.o(attn_output)
        return attn_output, position_bias


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config: Config, is_decoder: bool, has_relative_attention_bias: bool = False) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(config, is_decoder, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.width, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        normed_hidden_states = self.layer_norm(hidden_states)
        attention_output, position_bias = self.SelfAttention(normed_hidden_states, mask=attention_mask,
                                                             position_bias=position_bias)
        return hidden_states + attention_output, position_bias


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.EncDecAttention = T5Attention(config, is_decoder=True, has_relative_attention_bias=False)
        self.layer_norm = T5LayerNorm(config.width, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor,
                position_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        normed_hidden_states = self.layer_norm(hidden_states)
        attention_output, position_bias = self.EncDecAttention(normed_hidden_states,
                                                               key_value_states=key_value_states,
                                                               position_bias=position_bias)
        return hidden_states + attention_output, position_bias


class T5Block(nn.Module):
    def __init__(self, config: Config, is_decoder: bool, has_relative_attention_bias: bool = False) -> None:
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList([T5LayerSelfAttention(config, is_decoder, has_relative_attention_bias)])
        if self.is_decoder:
            self.layer.append(T5LayerCrossAttention(config))
        self.layer.append(T5LayerFF(config))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_bias: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                encoder_decoder_position_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        hidden_states, position_bias = self.layer[0](hidden_states, attention_mask=attention_mask,
                                                     position_bias=position_bias)
        if self.is_decoder:
            hidden_states, encoder_decoder_position_bias = self.layer[1](
                hidden_states, key_value_states=encoder_hidden_states, position_bias=encoder_decoder_position_bias)
        hidden_states = self.layer[-1](hidden_states)
        return hidden_states, position_bias, encoder_decoder_position_bias


class T5Stack(nn.Module):
    def __init__(self, config: Config, embed_tokens: nn.Embedding, is_decoder: bool) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.is_decoder = is_decoder
        self.block = nn.ModuleList([T5Block(config, is_decoder, has_relative_attention_bias=bool(i == 0))
                                    for i in range(config.layers)])
        self.final_layer_norm = T5LayerNorm(config.width, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        batch_size, seq_length = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        extended_attention_mask = None
        if self.is_decoder:
            # ModuleUtilsMixin.create_extended_attention_mask_for_decoder, every position attended:
            # [batch, 1, T, T], 0 on and below the diagonal and the dtype's minimum above it.
            seq_ids = torch.arange(seq_length, device=input_ids.device)
            causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
            extended_attention_mask = causal_mask[:, None, :, :].to(hidden_states.dtype)
            extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(hidden_states.dtype).min

        position_bias = None
        encoder_decoder_position_bias = None
        for layer_module in self.block:
            # The first layer computes the bias (with the mask folded in); every later layer reuses it.
            hidden_states, position_bias, encoder_decoder_position_bias = layer_module(
                hidden_states, attention_mask=extended_attention_mask, position_bias=position_bias,
                encoder_hidden_states=encoder_hidden_states,
                encoder_decoder_position_bias=encoder_decoder_position_bias)
        return self.final_layer_norm(hidden_states)


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model_dim = config.width
        self.shared = nn.Embedding(config.vocab, config.width)
        self.encoder = T5Stack(config, self.shared, is_decoder=False)
        self.decoder = T5Stack(config, self.shared, is_decoder=True)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)
        self.lm_head.weight = self.shared.weight  # tied
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """T5's initialization (factor 1.0), which takes the place of scaling the scores: Mesh TensorFlow's."""
        d_model, d_kv, n_heads, d_ff = self.config.width, self.config.d_kv, self.config.heads, self.config.ff
        if isinstance(module, T5LayerNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, T5ForConditionalGeneration):
            module.shared.weight.data.normal_(mean=0.0, std=1.0)
        elif isinstance(module, T5DenseActDense):
            module.wi.weight.data.normal_(mean=0.0, std=d_model**-0.5)
            module.wo.weight.data.normal_(mean=0.0, std=d_ff**-0.5)
        elif isinstance(module, T5Attention):
            module.q.weight.data.normal_(mean=0.0, std=(d_model * d_kv) ** -0.5)
            module.k.weight.data.normal_(mean=0.0, std=d_model**-0.5)
            module.v.weight.data.normal_(mean=0.0, std=d_model**-0.5)
            module.o.weight.data.normal_(mean=0.0, std=(n_heads * d_kv) ** -0.5)
            if module.has_relative_attention_bias:
                module.relative_attention_bias.weight.data.normal_(mean=0.0, std=d_model**-0.5)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        encoder_outputs = self.encoder(input_ids)
        sequence_output = self.decoder(decoder_input_ids, encoder_hidden_states=encoder_outputs)
        # Rescale output before projecting on vocab (the embedding is tied)
        sequence_output = sequence_output * (self.model_dim**-0.5)
        return self.lm_head(sequence_output)


def inputs(model: T5ForConditionalGeneration, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    decoder_seq = model.config.decoder_seq or seq
    return (torch.randint(0, model.config.vocab, (batch, seq), device=DEVICE),
            torch.randint(0, model.config.vocab, (batch, decoder_seq), device=DEVICE))


def main(argv: list[str] | None = None):
    return run_model("T5", lambda size, seq: T5ForConditionalGeneration(SIZES[size]), inputs, next_token_loss, SIZES,
                     BATCH, SEQ, argv)


if __name__ == "__main__":
    main()
