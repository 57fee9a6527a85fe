"""Print the attention support matrix as a markdown table, from the families in tests/attention/forms.

Each family's module says what its forms fuse into (`FEATURES`), what near twin of them is left as written and
why (`DECLINED`, `DECLINED_REASON`: a substring of the report's reason) and, in a line, what forms it covers
(`SUMMARY`); its tests check all of it. Nothing is compiled here: the table is made from those constants.

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
    features = ", ".join(f"`{name}`" for name in module.FEATURES) or "no features"
    twin = module.DECLINED.__name__ if hasattr(module.DECLINED, "__name__") else type(module.DECLINED).__name__
    return (f"| {name} | yes: {cell(features)} | `{twin}`: \"{cell(module.DECLINED_REASON)}\" | "
            f"{cell(module.SUMMARY)} |")


def main() -> None:
    sys.path.insert(0, str(TESTS))  # the forms import `support` and `attention.forms.common` from there
    import torch

    if not torch.cuda.is_available():  # chosen before triton is imported, as tests/conftest.py does
        os.environ.setdefault("TRITON_INTERPRET", "1")
    lines = ["| family | fused (with features) | declined twin (its reason) | summary |",
             "| --- | --- | --- | --- |"]
    lines += [row(name) for name in families()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
