"""Print the attention support matrix as a markdown table, from the families in tests/attention/forms.

Each family's module says, in a line, what forms it covers (`SUMMARY`) and the features the report names for
them (`FEATURES`); its tests check both, and that a near twin (`DECLINED`) is left as written for the reason it
gives. Nothing is compiled here: the table is made from those constants.

    .venv/bin/python scripts/support_matrix.py
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
FORMS = TESTS / "attention" / "forms"
# The families in the order the table lists them; any other family module comes after them, by name.
ORDER = ["plain", "causal", "sliding_window", "padding", "documents", "alibi", "t5_relative_bias", "softcap", "gqa",
         "cross_attention", "dropout", "additive_bias"]


def families() -> list[str]:
    names = [path.stem.removeprefix("test_") for path in FORMS.glob("test_*.py")]
    return sorted(names, key=lambda name: (ORDER.index(name) if name in ORDER else len(ORDER), name))


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def row(name: str) -> str:
    module = importlib.import_module(f"attention.forms.test_{name}")
    features = ", ".join(f"`{name}`" for name in module.FEATURES) or "—"
    return f"| {name.replace('_', ' ')} | {cell(module.SUMMARY)} | {features} |"


def main() -> None:
    sys.path.insert(0, str(TESTS))  # the forms import `support` and `attention.forms.common` from there
    import torch

    if not torch.cuda.is_available():  # chosen before triton is imported, as tests/conftest.py does
        os.environ.setdefault("TRITON_INTERPRET", "1")
    lines = ["| family | fused as written | the report's features |", "| --- | --- | --- |"]
    lines += [row(name) for name in families()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
