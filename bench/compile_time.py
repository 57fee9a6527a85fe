"""Where the first call of a compiled example goes: Dynamo, AOTAutograd, fusepass's passes, Triton's compiler.

    PYTHONPATH=. python bench/compile_time.py [--models causal,alibi] [--backend fusepass|inductor]

Each model's first call runs in a fresh process twice, both processes sharing one new Triton cache directory:
the first (cold) compiles every kernel, the second (warm) finds them on disk. The child runs under cProfile and
reports the wall time of the call, the cumulative seconds of the stages below, and per Triton kernel the
seconds its compile took (cold) or its cache lookup (warm), in the order they ran.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import keep

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Stage -> (file suffix, function) of the outermost call that stands for it.
STAGES = {
    "dynamo": ("torch/_dynamo/convert_frame.py", "_compile"),
    "aot autograd": ("torch/_functorch/aot_autograd.py", "aot_module_simplified"),
    "fusepass passes": ("fusepass/pipeline.py", "compile_graph"),
    "triton compile": ("triton/compiler/compiler.py", "compile"),
}


def model(name: str):
    import torch

    sys.path.insert(0, str(EXAMPLES))
    import alibi
    import causal_attention

    q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / 16) for i in range(16)], device="cuda")
    return {"causal": (causal_attention.causal_attention, (q, k, v)),
            "alibi": (alibi.alibi_attention, (q, k, v, slopes))}[name]


def child(name: str, backend_name: str) -> None:
    import torch
    import triton.runtime.jit as jit

    import fusepass

    fn, args = model(name)
    kernels = []
    do_compile = jit.JITFunction._do_compile

    def timed(self, *a, **kw):
        start = time.perf_counter()
        kernel = do_compile(self, *a, **kw)
        kernels.append((self.fn.__name__, round(time.perf_counter() - start, 3)))
        return kernel

    jit.JITFunction._do_compile = timed
    backend = fusepass.backend(strict=True) if backend_name == "fusepass" else backend_name
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    torch.compile(fn, backend=backend)(*args)
    torch.cuda.synchronize()
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats
    stages = {stage: sum(entry[3] for (file, _, func), entry in stats.items() if file.endswith(suffix) and func == f)
              for stage, (suffix, f) in STAGES.items()}
    print(json.dumps({"wall s": wall, **stages, "kernels": kernels}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="causal,alibi")
    parser.add_argument("--backend", default="fusepass")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.backend)
        return
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            for cache_state in ("cold", "warm"):
                out = subprocess.run([sys.executable, __file__, "--child", name, "--backend", args.backend],
                                     env=env, capture_output=True, text=True, check=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                kernels = result.pop("kernels")
                rows.append({"model": name, "cache": cache_state, **result,
                             "kernels (s)": ", ".join(f"{k} {s}" for k, s in kernels)})
                print(rows[-1], flush=True)
    print(keep(f"compile-time-{args.backend}", ["model", "cache", "wall s", *STAGES, "kernels (s)"], rows))


if __name__ == "__main__":
    main()
