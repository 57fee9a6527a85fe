"""Registers, spills, shared memory and pipelining of the flash kernels for the H200, on any machine.

    PYTHONPATH=. python bench/kernel_resources.py [--mask causal|window|document|packed|alibi|none|softcap|softcap-window]
        [--head-dim 128] [--head-dim-v 128] [--group 4] [--no-descriptors] [--forward 128,64,8,3,1] [--dkdv 32,128,8,3,1]
        [--dkdv-apart] [--dq 128,64,8,3,1] [--forward-only]

Compiles the forward, dK/dV and dQ kernels (with the score functions of ``bench/flash_sweep.py``) for sm_90
through Triton's own compiler and ptxas, no GPU needed: a stand-in driver names the target, and every launch
becomes a compile. Prints per kernel the registers per thread, the stack frame (spilled registers live
there), shared memory, and for each pipelined loop its buffers per operand and how many async copies it
may leave in flight (``async_wait`` num): what decides whether a tile change can pay before it costs GPU
time. Configs are block_m,block_n,num_warps,num_stages,descriptors (0 or 1)[,head_group]; the defaults are
``flash_config``'s for the H200 (with descriptors, as there; pointer loads with --no-descriptors). Each kernel's
launcher source is generated too, as at its first launch (not compiled): Triton 3.6's checks the descriptors among
its arguments against the compiled kernel's.

Registers depend on Triton's version. With the GPU machine's (``pip install --no-deps --target DIR
triton==3.6.0``, then ``PYTHONPATH=DIR:.``) the stack frame follows the spill count its kernels report
there, at about four bytes each: the causal dK/dV kernel's 128 bytes here, 30 spills there (88 bytes and 22
at an earlier commit; 8 bytes and 10 for the unmasked one at 64 × 128 and 8 warps).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
import triton.runtime.jit as jit
from flash_sweep import CAUSAL, PACKED, PLAIN, SOFTCAP, SOFTCAP_WINDOW, minus_inf, scaled, scaled_grad
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from fusepass.flash.score_mod import ScoreMod
from fusepass.flash import backward as flash_bwd, config as flash_config, forward as flash_fwd
from fusepass.runtime import launch
from fusepass.flash.config import GPU_HEAD_GROUP, BackwardConfigs, FlashConfig

H200 = GPUTarget("cuda", 90, 32)


class CompileOnlyDriver:
    """What a launch asks of the driver before it compiles; the compiled kernel is never loaded."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return H200

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compile_launches() -> list[tuple[str, object]]:
    """Make every Triton launch a compile (warmup) and collect the compiled kernels, in launch order."""
    driver.set_active(CompileOnlyDriver())
    compiled = []
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = compile_only
    # Through Triton on every launch: a bound launch would call the compiled kernel it got the first time.
    launch.BoundLaunch.__call__ = lambda self, grid, *args: self.kernel[grid](*args, **self.keywords)
    return compiled


def check_launcher(kernel) -> None:
    """Generate the launcher's source of a compiled kernel as the driver does before its first launch (a tuple
    of descriptors as an argument failed an assert there under triton 3.6, on the GPU only)."""
    from triton.backends.nvidia.driver import make_launcher
    src = kernel.src
    constants = {(src.fn.arg_names.index(key),) if isinstance(key, str) else key: value
                 for key, value in src.constants.items()}
    make_launcher(constants, dict(src.signature), getattr(kernel.metadata, "tensordesc_meta", None))


def resources(kernel) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    ttgir = kernel.asm["ttgir"]
    buffers = sorted(set(re.findall(r"memdesc<(\d+)x\d+x\d+x\w+, #shared", ttgir)))
    waits = re.findall(r"ttg.async_wait [^{]*\{num = (\d+)", ttgir)
    return {"registers": int(found[1]), "stack bytes": int(found[2]), "shared bytes": kernel.metadata.shared,
            "buffers per operand": ", ".join(buffers) or "-", "async_wait num": ", ".join(waits) or "-"}


@triton.jit
def window_keep(b, h, q_idx, kv_idx, aux):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)


@triton.jit
def document_keep(b, h, q_idx, kv_idx, aux):
    # aux[0]: the document id of each position, [batch, seq] int64 (as the suite's document case)
    return tl.load(aux[0] + b * aux[1] + q_idx) == tl.load(aux[0] + b * aux[1] + kv_idx)


@triton.jit
def alibi_score(s, b, h, q_idx, kv_idx, aux):
    # aux[0]: the slope of each head, fp32 (as the suite's ALiBi case, under a causal mask)
    return s * 0.08838834764831845 + tl.load(aux[0] + h) * (kv_idx - q_idx).to(tl.float32)


WINDOW = ScoreMod(name="resources_window", score=scaled, score_grad=scaled_grad, keep=window_keep, fill=minus_inf)
DOCUMENT = ScoreMod(name="resources_document", score=scaled, score_grad=scaled_grad, keep=document_keep,
                    fill=minus_inf, keep_uses_batch=True, keep_reads_aux=True)
ALIBI = ScoreMod(name="resources_alibi", score=alibi_score, score_grad=scaled_grad, keep=CAUSAL.keep,
                 fill=minus_inf)
MASKS = {"causal": CAUSAL, "window": WINDOW, "document": DOCUMENT, "packed": PACKED, "alibi": ALIBI, "none": PLAIN,
         "softcap": SOFTCAP, "softcap-window": SOFTCAP_WINDOW}
# The aux tensors each stand-in reads, by sequence length.
AUX = {"document": lambda seq, heads: (torch.zeros(1, seq, dtype=torch.int64), seq),
       "packed": lambda seq, heads: (torch.zeros(1, seq, dtype=torch.int64), seq),
       "alibi": lambda seq, heads: (torch.ones(heads, dtype=torch.float32),)}


def config(text: str | None, default: FlashConfig) -> FlashConfig:
    if not text:
        return default
    block_m, block_n, num_warps, num_stages, descriptors, *head_group = map(int, text.split(","))
    return FlashConfig(block_m, block_n, num_warps, num_stages, bool(descriptors), (head_group or [GPU_HEAD_GROUP])[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mask", choices=tuple(MASKS), default="causal")
    parser.add_argument("--head-dim", type=int, default=128, help="Q's and K's")
    parser.add_argument("--head-dim-v", type=int, help="V's (multi-head latent attention: 128 at --head-dim 192); "
                        "--head-dim's where not given")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--group", type=int, default=1, help="query heads per kv head (GQA)")
    parser.add_argument("--forward")
    parser.add_argument("--dkdv")
    parser.add_argument("--dq")
    parser.add_argument("--dkdv-apart", action="store_true", help="dK and dV in launches of their own "
                        "(BackwardConfigs.apart); the default configs' choice where not given")
    parser.add_argument("--no-descriptors", action="store_true", help="default configs load through pointers")
    parser.add_argument("--forward-only", action="store_true", help="the forward without gradients alone")
    args = parser.parse_args()
    mod = MASKS[args.mask]
    flash_config.has_tma = lambda device: not args.no_descriptors
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    head_dim_v = args.head_dim_v or args.head_dim
    width = flash_config.tile_width(args.head_dim, head_dim_v)
    forward = config(args.forward, flash_config.forward_config(width, dtype, mod.has_mask, cuda))
    defaults = flash_config.backward_configs(width, dtype, mod.has_mask, cuda)
    backward = BackwardConfigs(config(args.dkdv, defaults.dkdv), config(args.dq, defaults.dq),
                               args.dkdv_apart or defaults.apart)
    flash_fwd.forward_config = lambda *_: forward
    # At the given tiles: the maps are never built here (every launch only compiles), so a row length read
    # from one is whatever its memory held.
    flash_fwd.narrow_kv_tiles = lambda config, wide_map: config
    flash_bwd.backward_configs = lambda *_: backward

    compiled = compile_launches()
    q = torch.randn(1, 2 * args.group, args.seq, args.head_dim, dtype=dtype)
    k = torch.randn(1, 2, args.seq, args.head_dim, dtype=dtype)
    v = torch.randn(1, 2, args.seq, head_dim_v, dtype=dtype)
    aux = AUX[args.mask](args.seq, 2 * args.group) if args.mask in AUX else ()
    # A training forward in bf16 (the backward follows) computes the exact weights and keeps the output's residual,
    # as the backward kernels read them (`forward.keeps_residual`); a forward without gradients does neither.
    outputs = flash_fwd.forward_outputs(q, mod, None, q.device, backward=not args.forward_only, head_dim_v=head_dim_v)
    out, lse, extra = flash_fwd.flash_attention_forward(q, k, v, mod, aux, outputs=outputs)
    if not args.forward_only:
        flash_bwd.flash_attention_backward(torch.randn_like(out), q, k, v, out, lse, extra, mod, aux, None)
    print(f"sm_90, triton {triton.__version__}, {args.mask}, D={args.head_dim}, Dv={head_dim_v}, group {args.group}: "
          f"forward {forward}, dK/dV {backward.dkdv}{' apart' if backward.apart else ''}, dQ {backward.dq}")
    for name, kernel in compiled:
        if name.startswith("_flash"):
            check_launcher(kernel)
            print(f"{name}: {resources(kernel)}")


if __name__ == "__main__":
    main()
