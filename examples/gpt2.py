"""GPT-2 as nanoGPT writes it: ``c_attn(x).split``, a registered ``tril`` buffer with ``masked_fill``, a GELU
(tanh) MLP, LayerNorm, and an LM head tied to the token embedding over the real vocabulary of 50257.

    python examples/gpt2.py [--size tiny|small|medium] [--train] [--batch B] [--seq T]

Compares eager, Inductor and fusepass on it (on a GPU in bf16, timed; without one at the tiny size through
Triton's interpreter, checked only) and prints fusepass's summary of what it fused.
"""
from __future__ import annotations

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
    width: int
    vocab: int = 50257
    context: int = 1024


SIZES = {"tiny": Config(2, 2, 32, vocab=97, context=64), "small": Config(12, 12, 768),
         "medium": Config(24, 16, 1024)}
BATCH = {"tiny": 2, "small": 8, "medium": 4}
SEQ = {"tiny": 23, "small": 1024, "medium": 1024}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.width, 3 * config.width)
        self.c_proj = nn.Linear(config.width, config.width)
        self.n_head, self.n_embd = config.heads, config.width
        self.register_buffer("bias", torch.tril(torch.ones(config.context, config.context))
                             .view(1, 1, config.context, config.context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.width, 4 * config.width)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Embedding(config.context, config.width)
        self.h = nn.ModuleList([Block(config) for _ in range(config.layers)])
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def inputs(model: GPT, batch: int, seq: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, model.config.vocab, (batch, seq), device=DEVICE),)


def main(argv: list[str] | None = None):
    def build(size: str, seq: int) -> GPT:  # positions for every token of a longer sequence than the size's
        return GPT(replace(SIZES[size], context=max(SIZES[size].context, seq)))

    return run_model("GPT-2", build, inputs, next_token_loss, SIZES, BATCH, SEQ, argv)


if __name__ == "__main__":
    main()
