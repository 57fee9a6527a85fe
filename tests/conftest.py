"""Tests run every kernel on the CPU through Triton's interpreter.

The interpreter must be chosen before triton is imported, so it is set here, at collection time, unless a
CUDA device is present (then the same tests run the compiled kernels).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_rounding import round_to_nearest

    round_to_nearest()  # bf16 conversions as the GPU rounds them
    from interpreter_device_calls import patch_language_once_per_launch

    patch_language_once_per_launch()

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# The random-program tests draw the same examples in every run, so that a run's outcome is the commit's
# (`--hypothesis-profile=explore` draws new ones, as a search for bugs does).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    from fusepass.runtime.launch import finish_compiles_ahead

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    finish_compiles_ahead()  # none running on into the next test, whose warnings they could swallow


@pytest.fixture
def graphs_off(monkeypatch):
    """For tests of what a compiled graph's ops do call by call (the SDPA floor's choice, per-op replays and their
    keys), which a whole-graph replay (on by default on the GPU) does not run: graphs off for the
    backend by name and for those the test makes."""
    import dataclasses

    from fusepass.options import GRAPHS_ENV
    from fusepass.pipeline import fusepass_backend

    monkeypatch.setenv(GRAPHS_ENV, "0")
    monkeypatch.setattr(fusepass_backend, "options", dataclasses.replace(fusepass_backend.options, graphs=False))
