"""SASS instructions of the kernel fusepass generates for `gelu(x*0.5+b)*sigmoid(x)` at 8192², for sm_90, on
any machine, beside an Inductor-style kernel of the same chain (one flat axis, 1024 elements per program):
in a compute-bound chain the instruction count is what the time follows.

    PYTHONPATH=. python bench/pointwise_sass.py

A child process compiles the chain with fusepass through Triton's interpreter and writes the generated source
and the sizes and strides of its launch; this process compiles it at the GPU's tiles for the H200 through
`kernel_resources.py`'s stand-in driver and counts the instructions of the cubin (cuobjdump).
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from harness import keep
from kernel_resources import compile_launches, resources
from triton.language.extra import libdevice

N = 8192

CHILD = f"""
import json, sys, torch, torch.nn.functional as F
import fusepass
from fusepass.elementwise import kernel as pointwise
seen = {{}}
source = pointwise.kernel_source
pointwise.kernel_source = lambda *a: seen.setdefault("source", source(*a))
plan = pointwise.PointwiseLauncher._plan
def planned(self, inputs):
    p = plan(self, inputs)
    seen["launch"] = dict(bound=p.launch.bound_args, name=self.__name__)
    return p
pointwise.PointwiseLauncher._plan = planned
x, b = torch.randn({N}, {N}, dtype=torch.bfloat16), torch.randn({N}, dtype=torch.bfloat16)
torch.compile(lambda x, b: F.gelu(x * 0.5 + b) * torch.sigmoid(x), backend=fusepass.backend(graphs=False))(x[:64], b)
print(json.dumps(seen))
"""


@triton.jit
def inductor_style(in_ptr0, in_ptr1, out_ptr0, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    x = tl.load(in_ptr0 + xindex).to(tl.float32)
    b = tl.load(in_ptr1 + xindex % 8192, eviction_policy="evict_last").to(tl.float32)
    t = x * 0.5 + b
    out = t * 0.5 * (1.0 + libdevice.erf(t * 0.7071067811865476)) * tl.sigmoid(x)
    tl.store(out_ptr0 + xindex, out.to(tl.bfloat16))


def instructions(kernel) -> collections.Counter:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    return collections.Counter(op.split(".")[0] for op in re.findall(r"/\*[0-9a-f]{4}\*/\s+([A-Z0-9_.]+)", sass))


def generated() -> tuple[str, dict]:
    """The kernel fusepass generates for the chain (its rows cut to 64 for the interpreter: the same variant, and
    sizes and strides that Triton specializes alike), its name and the sizes and strides it is launched with."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    return seen["source"], seen["launch"]


def main() -> None:
    source, launch = generated()
    from fusepass.codegen.modules import load_module  # after the child: this process compiles for the GPU

    from fusepass.elementwise.kernel import choose_blocks

    kernel = getattr(load_module(source), launch["name"])
    compiled = compile_launches()
    x, b = torch.empty(N, N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    xblock, yblock, num_warps = choose_blocks([N, N])  # the GPU's tiles (the child's were the interpreter's)
    keywords = dict(XBLOCK=xblock, YBLOCK=yblock, num_warps=num_warps)
    kernel[(N // xblock, N // yblock)](x, b, out, *launch["bound"], **keywords)
    inductor_style[(N * N // 1024,)](x, b, out, XBLOCK=1024, num_warps=4)
    rows = []
    for (name, built), what in zip(compiled, ("fusepass", "Inductor-style")):
        counts = instructions(built)
        rows.append({"kernel": what, "instructions": sum(counts.values()),
                     "without NOP": sum(counts.values()) - counts["NOP"], "registers": resources(built)["registers"],
                     "integer ops": sum(counts[op] for op in ("IMAD", "ISETP", "IABS", "I2F", "F2I", "IADD3")),
                     "launch": f"XBLOCK {xblock}, YBLOCK {yblock}, {num_warps} warps" if what == "fusepass"
                     else "XBLOCK 1024, 4 warps"})
        print(rows[-1], flush=True)
    print(keep("pointwise-sass", list(rows[0]), rows,
               "gelu(x*0.5+b)*sigmoid(x), bf16 8192 x 8192, compiled for sm_90 without a GPU (SASS by cuobjdump)."))


if __name__ == "__main__":
    main()
