#!/usr/bin/env bash
# Creates .venv with fusepass (editable); with --test, also the test dependencies.
# torch is pinned to 2.13.0 (a CPU build where one lies on disk) unless the venv already has a torch:
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".${extras}"
