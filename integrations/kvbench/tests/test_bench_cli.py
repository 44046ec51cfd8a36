"""kvbench plumbing that needs no model: method discovery, argument checks, JSON / table / plot output."""

from __future__ import annotations

import json

import pytest
from kvcore import Compressor

from kvbench import cli
from kvbench.methods import build, discover
from kvbench.report import Row, format_table, plot, write_json


def test_discover_finds_every_default_method_and_hubkv():
    registry = discover()
    for name in ["full", *cli.DEFAULT_METHODS, "hubkv-snapkv"]:
        assert name in registry
    comp = build("snapkv", 0.75, registry)
    assert isinstance(comp, Compressor) and comp.budget.ratio == 0.75


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        build("nope", 0.5)
    assert cli.main(["--methods", "nope"]) == 2


def test_ratio_outside_range_is_refused():
    assert cli.main(["--ratios", "1.0"]) == 2


def test_reports(tmp_path):
    rows = [Row("full", 0.0, {"passkey@1000": 1.0}, kl=0.0, kv_bytes=2**20, kv_fraction=1.0, samples=3),
            Row("snapkv", 0.5, {"passkey@1000": 0.5}, kl=0.12, kv_bytes=2**19, kv_fraction=0.5, samples=3)]
    table = format_table(rows)
    assert table.count("\n") == 3 and "| snapkv | 0.5 | 0.50 |" in table
    write_json(rows, tmp_path / "r.json", {"command": "kvbench"})
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["mean_accuracy"] for r in data["results"]] == [1.0, 0.5]
    plot(rows, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refused_configuration_is_reported_not_fatal(tmp_path):
    rows = [Row("full", 0.0, {"passkey@1000": 1.0}, kv_fraction=1.0),
            Row("snapkv", 0.95, error="budget below the protected count")]
    table = format_table(rows)
    assert "not run: budget below the protected count" in table
    plot(rows, tmp_path / "r.png")  # the refused row is left out of the plot instead of breaking it
    assert (tmp_path / "r.png").exists()


def test_kvzip_and_hubkv_over_kvzip_are_registered():
    from kv_hubkv import HubKV

    from kv_hf import KVzipScorer

    registry = discover()
    base = build("kvzip", 0.75, registry)
    assert isinstance(base.scorer, KVzipScorer) and base.budget.granularity == "global"
    paired = build("hubkv-kvzip", 0.75, registry)
    assert isinstance(paired.scorer, HubKV) and isinstance(paired.scorer.base, KVzipScorer)
    assert paired.selector == base.selector and paired.budget == base.budget
