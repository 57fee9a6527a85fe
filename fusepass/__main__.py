"""``python -m fusepass report SCRIPT.py [args...]``: run a script, then print the report of every graph it
compiled with fusepass.

The script runs as ``__main__`` with ``sys.argv`` set to ``[SCRIPT.py, args...]`` and its folder first on
``sys.path``, as ``python SCRIPT.py args...`` would run it. Reports are printed after it ends (also when
it exits with an error), so they hold what only a first call records, such as measured times.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

import fusepass


def report(script: str, args: list[str]) -> int:
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    finally:
        compiled = fusepass.reports()
        print(f"\nfusepass: {len(compiled)} graph{'s' * (len(compiled) != 1)} compiled", flush=True)
        for r in compiled:
            print(f"\n{r}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusepass", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("report", help="run a script and print the report of every graph it compiled")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    return report(options.script, options.args)


if __name__ == "__main__":
    sys.exit(main())
