"""Where the first call of a compiled example goes, fusepass beside Inductor: the call's wall time, and the
seconds each Triton kernel's compile took and when it started.

    PYTHONPATH=. python bench/compile_time.py [--models causal,alibi,documents] [--backends fusepass,inductor]

Each model's first call (forward, and forward and backward) runs in a fresh process twice, both processes
sharing new Triton and Inductor cache directories: the first (cold) compiles every kernel, the second (warm)
finds them on disk. Per Triton kernel, in the order their compiles ended: the seconds its compile (cold) or
cache lookup (warm) took on whichever thread ran it, and how many seconds into the call it started (fusepass
compiles its flash kernels ahead, on threads, while the call goes on; Inductor in its own worker processes,
which this does not see). Per kernel loaded, the same for its launcher's build and its binary's load, which
Triton does at a kernel's first launch (fusepass on the compile thread), and on which thread.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import keep

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"



def model(name: str, backward: bool):
    import torch

    sys.path.insert(0, str(EXAMPLES))
    import alibi
    import causal_attention
    import padding_and_documents

    q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / 16) for i in range(16)], device="cuda")
    # Documents packed for causal language modelling: a map built in each call, from the ids.
    segments = torch.sort(torch.randint(0, 8, (2, 2048), device="cuda"), dim=-1).values
    return {"causal": (causal_attention.causal_attention, (q, k, v)),
            "alibi": (alibi.alibi_attention, (q, k, v, slopes)),
            "documents": (padding_and_documents.packed_causal, (q, k, v, segments))}[name]


def short(value) -> str:
    return hashlib.sha256(str(value).encode()).hexdigest()[:8]


def key_differences(cold: list[dict], warm: list[dict]) -> str:
    """For each kernel the warm process compiled under a hash the cold one did not, the parts of its cache key
    that no cold compile of that kernel had."""
    notes = []
    for kernel in warm:
        earlier = [c for c in cold if c["name"] == kernel["name"]]
        if earlier and kernel["hash"] not in {c["hash"] for c in earlier}:
            differ = sorted(part for part, value in kernel["parts"].items()
                            if all(c["parts"].get(part) != value for c in earlier))
            notes.append(f"{kernel['name']}: {', '.join(differ) or '(none)'}")
    return "; ".join(notes)


def child(name: str, backend_name: str, backward: bool) -> None:
    import torch
    import triton.runtime.jit as jit

    import fusepass

    fn, args = model(name, backward)
    kernels = []
    call_start = [0.0]
    do_compile = jit.JITFunction._do_compile

    def timed(self, key, signature, device, constexprs, options, attrs, warmup):
        start = time.perf_counter()
        kernel = do_compile(self, key, signature, device, constexprs, options, attrs, warmup)
        # The compiled binary's hash, and short hashes of what its cache key is made of: a kernel the warm
        # process compiles again under another hash had a key of its own there, and the parts say why.
        parts = {"fn": short(self.cache_key), "sig": short(signature), "opt": short(options), "attrs": short(attrs),
                 **{f"const {k}": short(getattr(v, "cache_key", v)) for k, v in constexprs.items()}}
        kernels.append({"name": self.fn.__name__, "s": round(time.perf_counter() - start, 3),
                        "at": round(start - call_start[0], 3),
                        "hash": getattr(kernel, "hash", "?")[:8], "parts": parts})
        return kernel

    jit.JITFunction._do_compile = timed
    # Triton builds a kernel's launcher (C, compiled) and loads its binary at its first launch, unless a compile
    # ahead did it on its thread (fusepass.runtime.launch): when, how long, and on which thread.
    from triton.compiler.compiler import CompiledKernel

    init_handles = CompiledKernel._init_handles
    main_thread = threading.get_ident()
    launchers = []

    def timed_handles(self):
        if self.module is not None:
            return init_handles(self)
        start = time.perf_counter()
        try:
            return init_handles(self)
        finally:
            launchers.append({"name": self.name, "s": round(time.perf_counter() - start, 3),
                              "at": round(start - call_start[0], 3),
                              "thread": "caller" if threading.get_ident() == main_thread else "compile"})

    CompiledKernel._init_handles = timed_handles
    backend = fusepass.backend(strict=True) if backend_name == "fusepass" else backend_name
    torch.cuda.synchronize()
    start = call_start[0] = time.perf_counter()
    out = torch.compile(fn, backend=backend)(*args)
    torch.cuda.synchronize()
    forward = time.perf_counter() - start
    if backward:
        out.sum().backward()
    torch.cuda.synchronize()
    print(json.dumps({"wall s": time.perf_counter() - start, "forward s": forward, "kernels": kernels,
                      "launchers": launchers}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="causal,alibi")
    parser.add_argument("--backends", default="fusepass,inductor")
    parser.add_argument("--child")
    parser.add_argument("--backend")
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.backend, args.backward)
        return
    rows = []
    for name in args.models.split(","):
        for backward in (False, True):
            for backend in args.backends.split(","):
                with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as inductor_cache:
                    env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
                    compiled = {}
                    for cache_state in ("cold", "warm"):
                        command = [sys.executable, __file__, "--child", name, "--backend", backend,
                                   *(["--backward"] if backward else [])]
                        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
                        result = json.loads(out.strip().splitlines()[-1])
                        compiled[cache_state] = result["kernels"]
                        rows.append({"model": name, "pass": "fwd+bwd" if backward else "fwd", "backend": backend,
                                     "cache": cache_state, "wall s": result["wall s"], "forward s": result["forward s"],
                                     "kernels (s at s, hash)": ", ".join(
                                         f"{k['name']} {k['s']} at {k['at']} {k['hash']}" for k in result["kernels"]),
                                     "keys unlike the cold run's": key_differences(compiled.get("cold", []),
                                                                                   result["kernels"])
                                     if cache_state == "warm" else "",
                                     "launchers (s at s, thread)": ", ".join(
                                         f"{k['name']} {k['s']} at {k['at']} {k['thread']}"
                                         for k in result["launchers"])})
                        print(rows[-1], flush=True)
    print(keep("compile-time", ["model", "pass", "backend", "cache", "wall s", "forward s", "kernels (s at s, hash)",
                                  "keys unlike the cold run's", "launchers (s at s, thread)"], rows))


if __name__ == "__main__":
    main()
