#!/usr/bin/env bash
# Every suite's headline figures and the GPU tests in one device call (under its 10-minute limit):
#
#     bash bench/session_run.sh        (from the repository root, on the GPU machine; carry .whl for the tests)
#
# Each suite writes bench/results/ as it always does; what this run wrote comes back as one archive,
# $OUT/results.tgz, beside $OUT/gpu-tests.log (the device tool returns at most 8 files). Budget: attention
# ~150 s, elementwise ~60 s, overhead ~60 s, compile time ~100 s, tests ~150 s.
set -u
export PYTHONPATH=$PWD
OUT_DIR=${OUT:-/tmp/session-run}
mkdir -p "$OUT_DIR"
unset OUT  # the suites write bench/results only; the archive carries them back
mark=$(mktemp)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
timeout 170 python bench/attention.py --shapes large --peers sdpa,flex 2>&1 | tail -20
timeout 70 python bench/elementwise.py --sizes 26 2>&1 | tail -11
(cd bench && timeout 70 python overhead.py 2>&1 | tail -10)
(cd bench && timeout 100 python compile_time.py --models causal 2>&1 | tail -10)
PYTHONPATH=/tmp/site:$PWD timeout 160 python -m pytest -o addopts="--import-mode=importlib" -q -n 14 \
    -p no:cacheprovider tests/attention tests/kernels tests/report tests/elementwise > "$OUT_DIR/gpu-tests.log" 2>&1
tail -3 "$OUT_DIR/gpu-tests.log"
find bench/results -newer "$mark" -type f -print0 | tar czf "$OUT_DIR/results.tgz" --null -T -
