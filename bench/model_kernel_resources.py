"""Registers and spills of an example model's attention kernels, as its training step launches them on the GPU,
compiled for sm_90 on any machine.

    PYTHONPATH=. python bench/model_kernel_resources.py --model t5 [--seq 128] [--batch 2]

Builds examples/<model>.py's model at its `small` widths, heads and head dims with 2 layers (its kernels are those of
every layer), in bf16 on the CPU, and runs one training step with every attention launch recorded instead of run,
at the tiles and warps the GPU would take (`flash_config`, descriptors on). Each distinct flash kernel is then
compiled for sm_90 through Triton's own compiler and ptxas (`kernel_resources.py`'s stand-in driver) and its
registers and stack frame printed: a kernel whose score functions hold more than the tiles' accumulators (a table
read per score, a gradient summed per distance) can spill at tiles that do not for plain attention. The Triton
installed here compiles; the GPU machine's version is the one that counts (``pip install --no-deps --target DIR
triton==3.6.0``, then ``PYTHONPATH=DIR:.``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import replace

import torch
from kernel_resources import CompileOnlyDriver, resources
from launch_cost import replace_attention_launches
from profile_models import EXAMPLES
from triton.runtime import driver

from fusepass import pipeline
from fusepass.flash import config as flash_config
from fusepass.runtime import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
# Each example's config field of its number of layers
LAYERS = {"bert": "num_hidden_layers", "bloom": "n_layer", "vit": "depth"}  # the others': `layers`


def gpu_tiles() -> None:
    """The flash configs the GPU takes, on any device (the interpreter's are 16 × 16), wherever fusepass asks for
    them (the kernels' launches, the block maps' tiles, the compiles ahead)."""
    cuda = torch.device("cuda")
    flash_config.has_tma = lambda device: True
    for cached in (flash_config.forward_config, flash_config.backward_configs):
        def on_gpu(head_dim, dtype, has_mask, device, chosen=cached.__wrapped__):
            return chosen(head_dim, dtype, has_mask, cuda)

        for module in [m for name, m in sys.modules.items() if name.startswith("fusepass")]:
            for attribute, value in list(vars(module).items()):
                if value is cached:
                    setattr(module, attribute, on_gpu)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=sorted(EXAMPLES))
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    assert "TRITON_INTERPRET" not in os.environ, "the launches are recorded, not interpreted"
    example = importlib.import_module(args.model)
    os.environ.pop("TRITON_INTERPRET", None)  # examples/common.py sets it where there is no GPU
    config = example.SIZES["small"]
    layers = LAYERS.get(args.model, "layers")
    model = getattr(example, EXAMPLES[args.model][0])(replace(config, **{layers: 2})).to(torch.bfloat16)
    seq = args.seq or (config.img_size if args.model == "vit" else 128)
    inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x
                   for x in example.inputs(model, args.batch, seq))
    loss = getattr(example, EXAMPLES[args.model][1])

    recorded = []
    replace_attention_launches(lambda kernel, grid, *arguments, **keywords:
                               recorded.append((kernel, grid, arguments, keywords)))
    launch.BoundLaunch.__call__ = lambda self, grid, *arguments: None  # the pointwise kernels: not looked at here
    flash_config.compile_ahead = lambda *arguments, **keywords: None
    pipeline.kernels_can_run = lambda device: True
    gpu_tiles()
    loss(torch.compile(model, backend="fusepass")(*inputs)).backward()

    driver.set_active(CompileOnlyDriver())
    seen = set()
    for kernel, grid, arguments, keywords in recorded:
        name = kernel.fn.__name__
        key = (name, tuple((k, id(v) if callable(v) else v) for k, v in keywords.items()))
        if not name.startswith("_flash") or key in seen:
            continue
        seen.add(key)
        compiled = kernel.run(*arguments, grid=grid, warmup=True, **keywords)
        shown = {k: keywords[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "PARTIAL_TILES",
                                           "EXACT_WEIGHTS") if k in keywords}
        used = resources(compiled)
        print(f"{name} {shown}: {used['registers']} registers, {used['stack bytes']} bytes of stack")


if __name__ == "__main__":
    main()
