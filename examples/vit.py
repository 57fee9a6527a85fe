"""ViT-B/16 as timm's ``vision_transformer`` writes it (its non-fused attention path): patch embedding by a
strided ``Conv2d``, a class token, learned position embeddings, pre-norm blocks whose attention takes
``qkv = nn.Linear(dim, 3 * dim)`` reshaped ``(B, N, 3, heads, head_dim).permute(2, 0, 3, 1, 4)`` and
``q, k, v = qkv.unbind(0)``, then ``attn = (q * scale) @ k.transpose(-2, -1)``, softmax and no mask, a GELU MLP,
LayerNorm (eps 1e-6), and a classification head on the class token.

    python examples/vit.py [--size tiny|small|medium] [--train] [--batch B] [--seq T]

Here ``--seq`` is the image's side in pixels, which must be the size's (its position embeddings are learned for
it): the attention runs over (T / patch)² + 1 tokens, 197 for ViT-B/16 at 224 (and tokens/s counts batch × T).
small is ViT-B/16 (768 wide, 12 layers, 12 heads, 1000 classes), medium ViT-L/16 (1024, 24, 16). Compares eager,
Inductor and fusepass on it (on a GPU in bf16, timed; without one at the tiny size through Triton's interpreter,
checked only) and prints fusepass's summary of what it fused.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from common import DEVICE, run_model

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    depth: int
    embed_dim: int
    num_heads: int
    img_size: int = 224
    patch_size: int = 16
    num_classes: int = 1000
    mlp_ratio: float = 4.0


SIZES = {"tiny": Config(2, 32, 2, img_size=32, patch_size=8, num_classes=10), "small": Config(12, 768, 12),
         "medium": Config(24, 1024, 16)}
BATCH = {"tiny": 2, "small": 32, "medium": 16}
SEQ = {name: config.img_size for name, config in SIZES.items()}  # the image side, in pixels


class PatchEmbed(nn.Module):
    """2D image to patch embedding."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.img_size, self.patch_size = (img_size, img_size), (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        return self.norm(x)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0,
                 proj_drop: float = 0.0) -> None:
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


class Mlp(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        return self.drop2(x)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, norm_layer) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=True)
        self.ls1 = nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio))
        self.ls2 = nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        embed_dim = config.embed_dim
        self.patch_embed = PatchEmbed(config.img_size, config.patch_size, 3, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * .02)
        self.pos_drop = nn.Dropout(p=0.0)
        self.norm_pre = nn.Identity()
        self.blocks = nn.Sequential(*[Block(embed_dim, config.num_heads, config.mlp_ratio, norm_layer)
                                      for _ in range(config.depth)])
        self.norm = norm_layer(embed_dim)
        self.fc_norm = nn.Identity()
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Linear(embed_dim, config.num_classes)
        nn.init.normal_(self.cls_token, std=1e-6)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.norm_pre(x)
        x = self.blocks(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, 0]  # global_pool "token": the class token
        x = self.fc_norm(x)
        x = self.head_drop(x)
        return self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def inputs(model: VisionTransformer, batch: int, seq: int) -> tuple[torch.Tensor]:
    """A batch of images `seq` pixels on a side (the size's own: the position embeddings are learned for it)."""
    if seq != model.config.img_size:
        raise SystemExit(f"ViT: --seq is the image side, {model.config.img_size} at this size (got {seq})")
    return (torch.randn(batch, 3, seq, seq, device=DEVICE, dtype=model.patch_embed.proj.weight.dtype),)


def classification_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against fixed labels: the training step's loss, its values aside."""
    labels = torch.arange(logits.shape[0], device=logits.device) % logits.shape[-1]
    return F.cross_entropy(logits.float(), labels)


def main(argv: list[str] | None = None):
    return run_model("ViT", lambda size, seq: VisionTransformer(SIZES[size]), inputs, classification_loss,
                     SIZES, BATCH, SEQ, argv)


if __name__ == "__main__":
    main()
