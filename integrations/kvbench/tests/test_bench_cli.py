"""kvbench plumbing that needs no model: method discovery, the grid, argument checks, JSON / table / plot output."""

from __future__ import annotations

import json

import pytest

from kvbench import cli
from kvbench.budgets import parse_budget, parse_budgets
from kvbench.methods import MethodSpec, describe, parse_methods, plan_grid
from kvbench.report import Row, format_table, markdown_report, plot, write_json
from kvbench.stats import PairedDiff
from kvcore import Budget, Compressor
from kvcore.registry import Method, discover


def test_discover_finds_every_default_method_and_hubkv():
    registry = discover()
    for spec in [MethodSpec("full"), *parse_methods(cli.DEFAULT_METHODS), MethodSpec("hubkv-snapkv")]:
        assert spec.name in registry
    comp = registry["snapkv"].build(Budget(ratio=0.75))
    assert isinstance(comp, Compressor) and comp.budget.ratio == 0.75


def test_default_grid_is_the_documented_one():
    # evictions at each ratio, plain KIVI once (pinned to ratio 0), the full cache not in the grid (reference row)
    grid = plan_grid(discover(), parse_methods(cli.DEFAULT_METHODS), [0.5, 0.75, 0.9])
    expect = [(m, r) for m in ["streaming_llm", "snapkv", "knorm"] for r in [0.5, 0.75, 0.9]]
    assert [(g.name, g.budget.ratio) for g in grid] == expect + [("kivi-4", 0.0), ("kivi-2", 0.0)]


def _fixed(budget: Budget) -> Compressor:
    return discover()["full"].build()


def test_a_method_without_ratio_budgets_runs_once_at_its_default():
    fixed = Method("fixed", _fixed, "a method with one budget", budgets=frozenset())
    ratio = Method("evict", _fixed, "takes ratios", budgets=frozenset({"ratio"}))
    registry = {"fixed": fixed, "evict": ratio}
    grid = plan_grid(registry, parse_methods("fixed,evict,fixed"), [0.5, 0.9])
    assert [(g.name, g.budget) for g in grid] == [
        ("fixed", Budget()),
        ("evict", Budget(ratio=0.5)),
        ("evict", Budget(ratio=0.9)),
    ]
    with pytest.raises(ValueError, match="takes no budget"):
        plan_grid(registry, parse_methods("fixed@0.5"), [0.5])
    assert [(g.name, g.budget) for g in plan_grid(registry, parse_methods("fixed@0"), [0.5])] == [("fixed", Budget())]


def test_budgets_of_every_kind_go_to_the_methods_that_take_them():
    bits = Method("bits", _fixed, "takes average bits", budgets=frozenset({"avg_bits"}))
    evict = Method("evict", _fixed, "takes ratios and tokens", budgets=frozenset({"ratio", "tokens"}))
    registry = {"bits": bits, "evict": evict}
    budgets = parse_budgets("0.5,256t,2.5bits,4096bpt")
    grid = plan_grid(registry, parse_methods("bits,evict"), budgets)
    assert [(g.name, g.label) for g in grid] == [
        ("bits", "2.5bits"),
        ("bits", "4096bpt"),
        ("evict", "r0.5"),
        ("evict", "256t"),
        ("evict", "4096bpt"),
    ]
    assert [g.budget for g in grid if g.name == "bits"] == [Budget(avg_bits=2.5), None]  # the target is matched later
    with pytest.raises(ValueError, match=r"takes budgets by \['avg_bits'\], not ratio"):
        plan_grid(registry, parse_methods("bits@0.5"), budgets)
    with pytest.raises(ValueError, match="none of the run's budgets"):
        plan_grid(registry, parse_methods("bits"), parse_budgets("0.5"))
    assert [g.label for g in plan_grid(registry, parse_methods("bits@3bits/2bits"), budgets)] == ["3bits", "2bits"]


def test_budget_syntax():
    assert [str(b) for b in parse_budgets("0.5, r0.9,256t,2.5bits,4096bpt")] == [
        "r0.5",
        "r0.9",
        "256t",
        "2.5bits",
        "4096bpt",
    ]
    assert parse_budget("2.5bits").budget() == Budget(avg_bits=2.5)
    assert parse_budget("256t").budget() == Budget(tokens=256)
    for bad, match in [("1.5", r"\[0, 1\)"), ("abc", "is not a budget"), ("0.5t", "whole number"), ("0bits", "bits")]:
        with pytest.raises(ValueError, match=match):
            parse_budget(bad)
    with pytest.raises(ValueError, match="resolve it"):
        parse_budget("100bpt").budget()


def test_pinned_ratios_replace_the_run_ratios():
    specs = parse_methods(" snapkv@0.5/0.9 , knorm ,")
    assert specs == [MethodSpec("snapkv", (parse_budget("0.5"), parse_budget("0.9"))), MethodSpec("knorm")]
    grid = plan_grid(discover(), specs, [0.25])
    assert [(g.name, g.budget.ratio) for g in grid] == [("snapkv", 0.5), ("snapkv", 0.9), ("knorm", 0.25)]
    for bad, match in [
        ("snapkv@", "followed by budgets"),
        ("@0.5", "no method name"),
        ("snapkv@1.0", r"\[0, 1\)"),
        ("snapkv@x", "not a budget"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_methods(bad)


def test_list_prints_names_budget_kinds_and_descriptions(capsys):
    registry = discover()
    assert cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(registry)
    by_name = {line.split()[0]: line for line in lines}
    assert "ratio,tokens" in by_name["snapkv"] and registry["snapkv"].description in by_name["snapkv"]
    assert "default only (ratio 0)" in by_name["full"]
    assert describe(registry) == "\n".join(lines)


def test_unknown_method_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown method\\(s\\) \\['nope'\\]; registered: .*'snapkv'"):
        plan_grid(discover(), parse_methods("nope"), [0.5])
    assert cli.main(["--methods", "nope"]) == 2
    assert "registered:" in capsys.readouterr().err


def test_ratio_outside_range_is_refused():
    assert cli.main(["--ratios", "1.0"]) == 2
    assert cli.main(["--methods", "snapkv@0.5/1.5"]) == 2


def test_reports(tmp_path):
    rows = [
        Row("full", "r0", accuracy={"passkey@1000": 1.0}, scores=[1.0, 1.0], kl=0.0, bytes_per_token=2000.0),
        Row("snapkv", "r0.5", accuracy={"passkey@1000": 0.5}, scores=[1.0, 0.0], kl=0.12, bytes_per_token=1000.0),
    ]
    rows[1].d_acc = PairedDiff(-0.5, -1.0, 0.0, 20)
    rows[1].acc_ci = rows[0].acc_ci = PairedDiff(0.5, 0.0, 1.0, 20)
    rows[1].kl_ci = rows[1].d_kl = PairedDiff(0.12, 0.1, 0.14, 20)
    table = format_table(rows)
    assert table.count("\n") == 3
    assert "| snapkv | r0.5 | 1000 |" in table and "+0.1200 [+0.1000, +0.1400]*" in table
    write_json(rows, tmp_path / "r.json", {"command": "kvbench"})
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["mean_accuracy"] for r in data["results"]] == [1.0, 0.5]
    assert data["results"][1]["d_kl"]["low"] == 0.1 and data["results"][1]["scores"] == [1.0, 0.0]
    for metric in ("accuracy", "kl"):
        plot(rows, tmp_path / f"{metric}.png", metric=metric)
        assert (tmp_path / f"{metric}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="metric must be one of"):
        plot(rows, tmp_path / "x.png", metric="bogus")
    md = markdown_report(rows, {"command": "kvbench --profile quick", "wall_s": 12.0}, ["accuracy.png"])
    assert "Command: `kvbench --profile quick`" in md and table in md and "![accuracy.png](accuracy.png)" in md


def test_refused_configuration_is_reported_not_fatal(tmp_path):
    rows = [
        Row("full", "r0", accuracy={"passkey@1000": 1.0}, bytes_per_token=1.0),
        Row("snapkv", "r0.95", error="budget below the protected count"),
    ]
    table = format_table(rows)
    assert "not run: budget below the protected count" in table
    plot(rows, tmp_path / "r.png")  # the refused row is left out of the plot instead of breaking it
    assert (tmp_path / "r.png").exists()


def test_kvzip_and_hubkv_over_kvzip_are_registered():
    from kv_baselines import KVzipScorer
    from kv_hubkv import HubKV

    registry = discover()
    base = registry["kvzip"].build(Budget(ratio=0.75))
    assert isinstance(base.scorer, KVzipScorer) and base.budget == Budget(ratio=0.75, granularity="global")
    paired = registry["hubkv-kvzip"].build(Budget(ratio=0.75))
    assert isinstance(paired.scorer, HubKV) and isinstance(paired.scorer.base, KVzipScorer)
    assert paired.selector == base.selector and paired.budget == base.budget
