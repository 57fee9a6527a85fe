"""The example models (examples/*.py) at their tiny size, on this machine: each one's logits and every parameter's
gradient are eager's under fusepass (the examples' own runner raises where they are not), and its attention is
rewritten, forward and backward."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
MODELS = ["gpt2", "bert", "bloom", "llama", "t5", "gemma2", "vit"]


def _example(name: str):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # the examples import their runner, examples/common.py
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", MODELS)
def test_example_model_matches_eager(name):
    if not os.path.exists(os.path.join(EXAMPLES, f"{name}.py")):
        pytest.skip(f"examples/{name}.py not written yet")
    result = _example(name).main(["--size", "tiny"])
    fused = result.result("fusepass")
    assert not fused.missing_gradients
    kinds = {(r.kind, r.phase) for report in result.reports for r in report.rewrites}
    assert {("attention", "forward"), ("attention", "backward")} <= kinds, kinds
