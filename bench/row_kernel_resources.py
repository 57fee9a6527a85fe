"""Registers, shared memory and pipelined loads of the row kernels a case launches (a norm, a bias + GELU, their
backwards with column sums), compiled for sm_90 on any machine.

    PYTHONPATH=.:bench python bench/row_kernel_resources.py [--cases rmsnorm-gemma,layernorm] [--rows 24]
        [--wide-row-warps 16] [--triton DIR]

Runs each of bench/column_sums.py's cases forward and backward in Triton's interpreter at the case's row width and a
few rows (a row count changes no kernel: none is specialised on it), recording each row kernel's launch. Each kernel
is then written as it is for the GPU (the interpreter's source broadcasts a row's values where they are read) and
compiled for sm_90 by Triton's compiler and ptxas in a process of its own, specialised as Triton specialises that
launch's arguments (an int of 1 a constant, a multiple of 16 marked so), at the launch's tile and warps. `--triton
DIR`: a Triton of the GPU machine's version installed there (``pip install --no-deps --target DIR triton==3.6.0``);
its interpreter need not run here, its compiler does.

Prints per kernel its registers, stack bytes, shared memory, asynchronous copies (the loads a pipelined row walk
keeps in flight) and plain loads: a column walk whose registers pass 128 at 8 warps runs one program a
multiprocessor, not two.
"""
from __future__ import annotations

import os
import sys

if "--compile" not in sys.argv:  # recording runs the interpreter (set before triton is imported); compiling not
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
           torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8", torch.bool: "*i1"}


def record_launches(cases: list[str], rows: int, wide_row_warps: int | None) -> list[dict]:
    """Each distinct row kernel the cases launch: its GPU source, its arguments' kinds and values, its warps (a
    column walk holding one wide row at `wide_row_warps`, where given: `row_kernel.COLUMN_WIDE_ROW_WARPS`)."""
    from column_sums import CASES

    import fusepass
    from fusepass.codegen.modules import HEADER
    from fusepass.elementwise import kernel as pointwise
    from fusepass.elementwise import row_kernel
    from fusepass.runtime import launch

    if wide_row_warps is not None:
        row_kernel.COLUMN_WIDE_ROW_WARPS = wide_row_warps

    gpu_source: dict[str, str] = {}
    written = row_kernel.row_kernel_source

    def writing(name, program, spaces, variant, passes=None):
        text = written(name, program, spaces, variant, passes)
        if passes is None:
            row_kernel.interpreting = lambda: False
            try:
                gpu_source[HEADER + text] = HEADER + written(name, program, spaces, variant)
            finally:
                row_kernel.interpreting = lambda: True
        return text

    row_kernel.row_kernel_source = writing
    pointwise._kernels.clear()
    launches: dict[str, dict] = {}
    call = launch.BoundLaunch.__call__

    def recording(self, grid, *args):
        fn = self.kernel.fn
        with open(fn.__globals__["__file__"]) as f:
            text = f.read()
        if text in gpu_source and text not in launches:
            values = [*args, *self.bound_args]
            params = []
            for name, value in zip(fn.__code__.co_varnames, values):
                if isinstance(value, torch.Tensor):
                    params.append((name, POINTER[value.dtype], None))
                elif isinstance(value, float):
                    params.append((name, "fp32", None))
                else:
                    params.append((name, "i32" if abs(int(value)) < 2 ** 31 else "i64", int(value)))
            launches[text] = {"name": fn.__name__, "source": gpu_source[text], "params": params,
                              "unspecialized": re.findall(r"'(\w+)'", re.search(
                                  r"do_not_specialize=\[([^\]]*)\]", text)[1]) if "do_not_specialize" in text else [],
                              "constexprs": {k: v for k, v in self.keywords.items() if k != "num_warps"},
                              "num_warps": self.keywords.get("num_warps", 4)}
        return call(self, grid, *args)

    launch.BoundLaunch.__call__ = recording
    backend = fusepass.backend(graphs=False)
    for name, fn, shape, weights in CASES:
        if cases and not name.startswith(tuple(cases)):
            continue
        torch.manual_seed(0)
        x = torch.randn((rows, shape[-1]), dtype=torch.bfloat16, requires_grad=True)
        extra = [torch.randn(shape[-1], dtype=torch.bfloat16, requires_grad=True) for _ in range(weights)]
        torch._dynamo.reset()
        torch.compile(fn, backend=backend)(x, *extra).backward(torch.randn_like(x))
        for entry in launches.values():
            entry.setdefault("case", name)
    return list(launches.values())


def compile_one(entry: dict) -> str:
    """In a process without the interpreter: the kernel compiled for sm_90, its resources as a line."""
    import importlib.util

    import triton
    from kernel_resources import resources
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(entry["source"])
    spec = importlib.util.spec_from_file_location("row_kernel_offline", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, entry["name"])
    signature, constants, attrs = {}, dict(entry["constexprs"]), {}
    for name in entry["constexprs"]:
        signature[name] = "constexpr"
    for i, (name, kind, value) in enumerate(entry["params"]):
        if value == 1 and name not in entry["unspecialized"]:
            signature[name], constants[name] = "constexpr", 1
            continue
        signature[name] = kind
        if kind.startswith("*") or (value is not None and value % 16 == 0 and name not in entry["unspecialized"]):
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": entry["num_warps"]})
    used = resources(kernel)
    ttgir = kernel.asm["ttgir"]
    tile = "x".join(str(entry["constexprs"][k]) for k in ("XBLOCK", "RBLOCK") if k in entry["constexprs"])
    return (f"| {entry['case']} | {entry['name']} | {tile} | {entry['num_warps']} | {used['registers']} | "
            f"{used['stack bytes']} | {used['shared bytes']} | {ttgir.count('ttg.async_copy_global_to_local')} | "
            f"{ttgir.count('tt.load ')} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="", help="column_sums.py's cases whose names start so (all by default)")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--wide-row-warps", type=int, help="row_kernel.COLUMN_WIDE_ROW_WARPS")
    parser.add_argument("--triton", help="a directory holding the Triton to compile with")
    parser.add_argument("--compile", help=argparse.SUPPRESS)  # a recorded launch's JSON: compile it (subprocess)
    args = parser.parse_args()
    if args.compile:
        with open(args.compile) as f:
            print(compile_one(json.load(f)))
        return
    entries = record_launches([c for c in args.cases.split(",") if c], args.rows, args.wide_row_warps)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET")
    if args.triton:
        env["PYTHONPATH"] = os.pathsep.join([args.triton, env.get("PYTHONPATH", "")])
    print("| case | kernel | XBLOCK x RBLOCK | warps | registers | stack | shared bytes | async copies | loads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for entry in entries:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(entry, f)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile", f.name], env=env,
                              capture_output=True, text=True)
        print(done.stdout.strip() or f"| {entry['case']} | {entry['name']} | failed: "
                                     f"{done.stderr.strip().splitlines()[-1:]} |", flush=True)


if __name__ == "__main__":
    main()
