"""The attention pass: finds matmul → softmax → matmul and replaces it with the fused flash op."""
from __future__ import annotations

import torch.fx

from fusepass.context import PassContext


def rewrite_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    return gm
