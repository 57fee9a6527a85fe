"""``report.to_dict()`` / ``to_json()``: a round trip, and the documented schema (docs/report.schema.json)."""
from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

import fusepass
from fusepass.report.report import Report

SCHEMA = json.loads((pathlib.Path(__file__).parents[2] / "docs" / "report.schema.json").read_text())


def attention_and_chain(q, k, v):
    s = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.sigmoid(s @ v) * 2, torch.special.xlog1py(q, k)


@pytest.fixture(scope="module")
def report() -> Report:
    q, k, v = (torch.randn(2, 3, 32, 16, requires_grad=True) for _ in range(3))
    fusepass.reset()
    torch.compile(attention_and_chain, backend="fusepass")(q, k, v)
    return fusepass.last_report()


def test_round_trip(report):
    data = json.loads(report.to_json())
    assert data == report.to_dict()
    assert Report.from_dict(data).to_dict() == data
    assert {r["kind"] for r in data["rewrites"]} == {"attention", "elementwise"}
    assert data["hotspots"] and data["ceilings"]["source"] == "default"


def test_the_schema_names_every_field(report):
    data = report.to_dict()
    assert set(SCHEMA["properties"]) == set(data)
    assert set(SCHEMA["$defs"]["ceilings"]["properties"]) == set(data["ceilings"])
    for r in data["rewrites"]:
        assert set(SCHEMA["$defs"]["rewrite"]["properties"]) == set(r)
    for h in data["hotspots"]:
        assert set(SCHEMA["$defs"]["hotspot"]["properties"]) == set(h)


def test_the_schema_validates(report):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report.to_dict(), SCHEMA)
