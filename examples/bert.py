"""A BERT encoder as Hugging Face's ``modeling_bert`` writes it (its eager attention): word, position and
token-type embeddings under a LayerNorm, Q, K and V as three ``nn.Linear`` layers put into heads by
``transpose_for_scores``, the scores divided by sqrt(head_dim), a padding ``attention_mask`` of 1s and 0s turned
into an additive float mask ``(1.0 - mask[:, None, None, :]) * torch.finfo(dtype).min``, softmax, dropout
modules (at p = 0, so eager and fusepass compute the same values), post-LayerNorm residuals and an erf GELU
intermediate. It returns the last hidden state (no pooler, no MLM head).

    python examples/bert.py [--size tiny|small|medium] [--train] [--batch B] [--seq T]

small is BERT-base (12 layers, 768 wide, 12 heads), medium BERT-large (24, 1024, 16). The inputs pad the last
quarter of every other row. Compares eager, Inductor and fusepass on it (on a GPU in bf16, timed; without one at
the tiny size through Triton's interpreter, checked only) and prints fusepass's summary of what it fused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common import DEVICE, run_model

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Config:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    pad_token_id: int = 0
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.0  # BERT trains with 0.1; 0 keeps eager and fusepass comparable
    attention_probs_dropout_prob: float = 0.0


SIZES = {"tiny": Config(2, 32, 2, 128, vocab_size=101),
         "small": Config(12, 768, 12, 3072), "medium": Config(24, 1024, 16, 4096)}
BATCH = {"tiny": 2, "small": 8, "medium": 4}
SEQ = {"tiny": 19, "small": 512, "medium": 512}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)),
                             persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_shape = input_ids.size()
        seq_length = input_shape[1]
        position_ids = self.position_ids[:, :seq_length]
        token_type_ids = self.token_type_ids[:, :seq_length].expand(input_shape[0], seq_length)
        inputs_embeds = self.word_embeddings(input_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + token_type_embeddings
        embeddings += self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mixed_query_layer = self.query(hidden_states)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(mixed_query_layer)

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        # The additive mask (precomputed for all layers in BertModel.forward).
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(new_context_layer_shape)


class BertSelfOutput(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()  # hidden_act "gelu": the erf form

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        attention_output = self.attention(hidden_states, attention_mask)
        intermediate_output = self.intermediate(attention_output)
        return self.output(intermediate_output, attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class BertModel(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def get_extended_attention_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # [batch_size, seq_length] -> [batch_size, 1, 1, seq_length], broadcast over heads and queries; 0 where
        # attended, the dtype's most negative value where masked.
        extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=dtype)  # fp16 compatibility
        return (1.0 - extended_attention_mask) * torch.finfo(dtype).min

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, self.dtype)
        embedding_output = self.embeddings(input_ids)
        return self.encoder(embedding_output, extended_attention_mask)


def inputs(model: BertModel, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a padding mask: every other row's last quarter is padding (the pad token, mask 0)."""
    input_ids = torch.randint(1, model.config.vocab_size, (batch, seq), device=DEVICE)
    attention_mask = torch.ones(batch, seq, dtype=torch.long, device=DEVICE)
    attention_mask[1::2, seq - seq // 4:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, model.config.pad_token_id)
    return input_ids, attention_mask


def readout_loss(hidden_states: torch.Tensor) -> torch.Tensor:
    """The output read out through fixed random weights: a scalar of every output, for the training step's backward.
    (Not the mean square of the output: after the last LayerNorm that is 1 whatever the inputs, its gradient only
    rounding.)"""
    generator = torch.Generator(hidden_states.device).manual_seed(0)
    weights = torch.randn(hidden_states.shape, generator=generator, device=hidden_states.device)
    return (hidden_states.float() * weights).mean()


def main(argv: list[str] | None = None):
    return run_model("BERT", lambda size, seq: BertModel(SIZES[size]), inputs, readout_loss, SIZES, BATCH, SEQ, argv)


if __name__ == "__main__":
    main()
