"""kvbench's evaluation loop on a tiny random model: cells, protocols, resume, pairing, head-to-head comparisons,
equal-bytes matching, fast-tier bytes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kv_hf.testing import tiny_model
from kvbench import cli
from kvbench.budgets import parse_budgets
from kvbench.cells import CellCache
from kvbench.compare import Side, compare_rows, format_comparisons, parse_comparisons, validate_comparisons
from kvbench.match import match_budget
from kvbench.methods import GridItem
from kvbench.paired import pair_rows
from kvbench.report import Row, format_table, markdown_report, write_json
from kvbench.run import Workload, evaluate_samples, fp16_bytes_per_token, run_grid
from kvbench.tasks import TaskSample
from kvcore import Budget
from kvcore.registry import Method, discover


class CharTokenizer:
    """Bytes as tokens (the tiny model's vocabulary is 256)."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def workload() -> Workload:
    samples = [
        TaskSample("the key is 42. " * 6, " key?", ["42"], max_new_tokens=3, task="toy", target_length=100),
        TaskSample("the key is 7. " * 6, " the key?", ["7"], max_new_tokens=3, task="toy", target_length=100),
    ]
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(3, 256, (48,), generator=g).tolist(), torch.randint(3, 256, (8,), generator=g).tolist())]
    pairs.append(
        (torch.randint(3, 256, (48,), generator=g).tolist(), torch.randint(3, 256, (8,), generator=g).tolist())
    )
    return Workload(samples, pairs)


GRID = [GridItem("streaming_llm", Budget(ratio=0.5)), GridItem("knorm", Budget(ratio=0.5))]


class Recording(CellCache):
    def __init__(self, folder, context):
        super().__init__(folder, context)
        self.puts = self.partials = 0

    def put(self, cell, result):
        self.puts += not cell.get("partial")  # finished (or refused) cells; partial progress is counted apart
        self.partials += bool(cell.get("partial"))
        super().put(cell, result)


def test_rows_carry_per_unit_results_and_a_rerun_reuses_every_cell(tmp_path):
    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    cache = Recording(tmp_path, {"work": work.fingerprint()})
    rows = run_grid(model, tok, registry, GRID, work, protocols=["agnostic", "aware"], cache=cache, progress=False)
    assert [(r.method, r.budget, r.protocol) for r in rows] == [
        (m, b, p)
        for m, b in [("full", "r0"), ("streaming_llm", "r0.5"), ("knorm", "r0.5")]
        for p in ("agnostic", "aware")
    ]
    assert all(len(r.scores) == 2 and len(r.window_kl) == 2 for r in rows)
    assert rows[0].window_kl == [0.0, 0.0] and all(k > 0 for k in rows[2].window_kl)
    assert rows[2].window_kl == rows[3].window_kl  # windows have no question: one KL cell per (method, budget)
    # aware compresses the question with the context: more tokens in, so a ratio budget holds more bytes
    assert rows[3].kv_bytes > rows[2].kv_bytes
    full_bpt = fp16_bytes_per_token(model)
    assert rows[2].fp16_fraction == pytest.approx(rows[2].bytes_per_token / full_bpt)
    assert rows[2].bytes_per_token < rows[0].bytes_per_token
    first = cache.puts
    assert first == 2 + 2 * 3  # full: tasks (shared by both protocols) + KL; each method: 2 protocols + KL
    again = Recording(tmp_path, {"work": work.fingerprint()})
    rows2 = run_grid(model, tok, registry, GRID, work, protocols=["agnostic", "aware"], cache=again, progress=False)
    assert again.puts == 0
    assert [(r.scores, r.window_kl, r.kv_bytes) for r in rows2] == [(r.scores, r.window_kl, r.kv_bytes) for r in rows]
    other = Recording(tmp_path, {"work": "another workload"})  # a different context never reuses a cell
    run_grid(model, tok, registry, GRID[:1], work, cache=other, progress=False)
    assert other.puts == 2 + 2


def test_paired_rows_against_the_full_cache_and_a_named_base():
    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    rows = run_grid(model, tok, registry, GRID, work, progress=False)
    pair_rows(rows, "full")
    assert rows[1].reference == "full r0"
    assert rows[1].d_kl.mean == pytest.approx(rows[1].kl)  # vs the full cache, whose KL is 0 on every window
    assert rows[1].d_acc.mean == pytest.approx(sum(rows[1].scores) / 2 - sum(rows[0].scores) / 2)
    pair_rows(rows, "streaming_llm")
    assert rows[2].reference == "streaming_llm r0.5"
    expect = sum(a - b for a, b in zip(rows[2].window_kl, rows[1].window_kl)) / 2
    assert rows[2].d_kl.mean == pytest.approx(expect)
    with pytest.raises(ValueError, match="no row of method 'snapkv'"):
        pair_rows(rows, "snapkv")


def test_a_refused_budget_is_a_row_with_its_reason_and_is_not_retried(tmp_path):
    model, tok, work = tiny_model(), CharTokenizer(), workload()
    registry = discover()

    def refuse(budget):
        raise ValueError("budget below the protected count")

    registry["refuser"] = Method("refuser", refuse, "always refuses")
    cache = Recording(tmp_path, {})
    rows = run_grid(model, tok, registry, [GridItem("refuser", Budget(ratio=0.5))], work, cache=cache, progress=False)
    assert rows[1].error == "budget below the protected count"
    again = Recording(tmp_path, {})
    rows = run_grid(model, tok, registry, [GridItem("refuser", Budget(ratio=0.5))], work, cache=again, progress=False)
    assert again.puts == 0 and rows[1].error == "budget below the protected count"


def test_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="protocol must be one of"):
        evaluate_samples(tiny_model(), CharTokenizer(), discover()["full"].build(), workload().samples, "sideways")


def _fake(kinds):
    return Method("fake", lambda b: None, "fake", budgets=frozenset(kinds))


def test_match_budget_finds_the_closest_measured_budget():
    # held bytes fall linearly with the ratio: 1000 * (1 - r); the 400 B/token target is r = 0.6
    m = match_budget(_fake({"ratio", "tokens"}), 400.0, lambda b: 1000 * (1 - b.ratio))
    assert m.budget.ratio == pytest.approx(0.6, abs=0.01) and m.relative_error < 0.03
    # average bits are searched before ratio: 100 B/token per bit plus a fixed 30; 305 B is 2.75 bits
    m = match_budget(_fake({"ratio", "avg_bits"}), 305.0, lambda b: 100 * b.avg_bits + 30)
    assert m.budget.avg_bits == pytest.approx(2.75, abs=0.02)

    def refuses_low(b):  # a method that refuses budgets under 2 bits: they are skipped, not fatal
        if b.avg_bits < 2:
            raise ValueError("too few bits")
        return 100 * b.avg_bits

    assert match_budget(_fake({"avg_bits"}), 50.0, refuses_low).budget.avg_bits == 2.0
    with pytest.raises(ValueError, match="refused every avg_bits budget"):
        match_budget(_fake({"avg_bits"}), 50.0, lambda b: (_ for _ in ()).throw(ValueError("no")))
    with pytest.raises(ValueError, match="target must be"):
        match_budget(_fake({"ratio"}), 0.0, lambda b: 1.0)


@pytest.mark.filterwarnings("ignore:.*too short for the budget")  # the grid's high ratios on a 48-token prompt
def test_match_bytes_through_run_grid_uses_real_held_bytes():
    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    full = fp16_bytes_per_token(model) * 2  # the tiny model runs in float32: twice the fp16 bytes per token
    target = 0.4 * full
    grid = [GridItem("streaming_llm", None, parse_budgets(f"{target}bpt")[0])]
    rows = run_grid(model, tok, registry, grid, work, progress=False)
    assert rows[1].matched["target_bytes_per_token"] == target
    assert abs(rows[1].matched["calibration"] - target) / target < 0.1  # within a grid/bisection step
    assert rows[1].budget.startswith("r")


@pytest.mark.filterwarnings("ignore:.*too short for the budget")
def test_a_bytes_target_that_resolves_to_a_listed_budget_is_one_row():
    """``knorm@r`` and a bytes target that resolves to the same ``r`` are one row (one set of cells), carrying the
    match, and a comparison finds it under either name."""
    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    probe = run_grid(model, tok, registry, [GridItem("knorm", None, parse_budgets("9000bpt")[0])], work, progress=False)
    resolved = probe[1].budget  # what the target resolves to, e.g. r0.5...
    target = parse_budgets("9000bpt")[0]
    grid = [GridItem("knorm", Budget(ratio=float(resolved[1:]))), GridItem("knorm", None, target)]
    rows = run_grid(model, tok, registry, grid, work, progress=False)
    assert [(r.method, r.budget) for r in rows] == [("full", "r0"), ("knorm", resolved)]
    assert rows[1].matched["target_bytes_per_token"] == 9000
    for a in (f"knorm@{resolved}", "knorm@9000bpt"):
        (comparison,) = compare_rows(rows, parse_comparisons(f"{a}:full"))
        assert comparison.a == f"knorm {resolved}"
    before = _distinct_off(model, tok, registry, grid, work)
    assert [(r.method, r.budget) for r in before] == [("full", "r0"), ("knorm", resolved), ("knorm", resolved)]


def _distinct_off(model, tok, registry, grid, work):
    """The rows without the de-duplication (what an earlier kvbench listed): the test's witness that it binds."""
    from unittest import mock

    with mock.patch("kvbench.run._distinct", lambda items: items):
        return run_grid(model, tok, registry, grid, work, progress=False)


def test_cli_validates_everything_before_loading_the_model(monkeypatch, capsys):
    import kvbench.models

    def boom(*a, **k):
        raise AssertionError("the model must not be loaded for a bad option")

    monkeypatch.setattr(kvbench.models, "load_smollm2", boom)
    for argv, needle in [
        (["--tasks", "bogus"], "valid: "),
        (["--methods", "nope"], "registered:"),
        (["--budgets", "abc"], "is not a budget"),
        (["--reference", "nope"], "--reference: unknown method"),
        (["--reference", "snapkv", "--methods", "knorm"], "must also be among --methods"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
    ]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (argv, err)
    for argv in (["--lengths", "abc"], ["--depths", "2"], ["--samples", "0"], ["--protocol", "x"]):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args(argv)
        assert exc.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


def test_help_shows_defaults_without_markup(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text
    assert "(default: agnostic)" in text and "(default: quick)" in text and "quick 1000, paper 2000" in text
    assert re.search(r"\(\d+ s measured", text), "kvbench --help must state the default run's measured time"


def test_profiles_fill_defaults_and_options_override():
    quick = cli.parse_args([])
    assert (quick.lengths, quick.samples, quick.kl_samples) == ([1000], 1, 2)
    paper = cli.parse_args(["--profile", "paper"])
    assert paper.lengths == [2000] and paper.kl_samples >= 32 and paper.kl_context >= 1000
    assert len(paper.depths) * paper.samples >= 50
    assert cli.parse_args(["--profile", "paper", "--kl-samples", "3"]).kl_samples == 3


def test_rows_of_the_reference_are_skipped_when_pairing():
    rows = [Row("full", scores=[1.0, 0.0], window_kl=[0.0, 0.0]), Row("x", "r0.5", scores=[0.0, 0.0])]
    pair_rows(rows)
    assert rows[0].d_acc is None and rows[1].d_acc.mean == -0.5 and rows[1].kl_ci is None


def test_shared_prefills_give_the_per_cell_results():
    """The grid prefills each prompt once for all methods; its cells equal a prefill per method
    (evaluate_samples / evaluate_windows): same scores, held bytes and per-window KL."""
    from kvbench.run import evaluate_windows

    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    rows = run_grid(model, tok, registry, GRID, work, protocols=["aware"], progress=False)
    _, ref_lp = evaluate_windows(model, tok, registry["full"].build(), work.kl_pairs)
    for row, item in zip(rows[1:], GRID):
        compressor = registry[item.name].build(item.budget)
        alone = evaluate_samples(model, tok, compressor, work.samples, "aware")
        windows, _ = evaluate_windows(model, tok, compressor, work.kl_pairs, ref_lp)
        assert row.scores == alone["scores"]
        assert row.kv_bytes == pytest.approx(sum(alone["kv_bytes"] + windows["kv_bytes"]) / 4, rel=0, abs=0)
        assert row.window_kl == pytest.approx(windows["kl"], rel=0, abs=1e-6)


def test_an_interrupted_run_resumes_mid_cell_without_repeating_units(tmp_path, monkeypatch):
    """Progress is stored after every sample: a run killed during the second sample resumes there, and the
    resumed rows equal an uninterrupted run's."""
    import kvbench.run as run_mod

    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    work = Workload(work.samples, [])
    clean = run_grid(model, tok, registry, GRID, work, progress=False)
    real, calls = run_mod.generate_answer, []

    def dies_on_fourth(*a, **k):
        calls.append(1)
        if len(calls) == 4:  # full, streaming_llm, knorm on sample 1, then the first method of sample 2
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "generate_answer", dies_on_fourth)
    cache = Recording(tmp_path, {"work": work.fingerprint()})
    with pytest.raises(KeyboardInterrupt):
        run_grid(model, tok, registry, GRID, work, cache=cache, progress=False)
    assert cache.puts == 0 and cache.partials == 3  # nothing finished, three cells one sample in
    counted = []
    monkeypatch.setattr(run_mod, "generate_answer", lambda *a, **k: counted.append(1) or real(*a, **k))
    again = Recording(tmp_path, {"work": work.fingerprint()})
    rows = run_grid(model, tok, registry, GRID, work, cache=again, progress=False)
    assert len(counted) == 3  # only sample 2, once per method
    assert len(list((tmp_path).glob("*.json"))) == 3  # finished cells only: their progress files are gone
    assert [(r.scores, r.kv_bytes) for r in rows] == [(r.scores, r.kv_bytes) for r in clean]


def test_a_comparison_is_the_paired_difference_of_the_two_rows_on_the_same_units():
    """A − B per sample and per window, whatever the budgets, per protocol; the full cache (one protocol-free task
    cell) stands on either side under every protocol."""
    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    grid = [*GRID, GridItem("knorm", Budget(ratio=0.25))]
    rows = run_grid(model, tok, registry, grid, work, protocols=["agnostic", "aware"], progress=False)
    pairs = parse_comparisons("knorm@0.25:streaming_llm,full:knorm@0.5")
    validate_comparisons(pairs, grid)
    got = compare_rows(rows, pairs, seed=3)
    assert [(c.a, c.b, c.protocol) for c in got] == [
        ("knorm r0.25", "streaming_llm r0.5", "agnostic"),
        ("knorm r0.25", "streaming_llm r0.5", "aware"),
        ("full r0", "knorm r0.5", "agnostic"),
        ("full r0", "knorm r0.5", "aware"),
    ]
    by = {(r.method, r.budget, r.protocol): r for r in rows}
    for c in got:
        a = by[(*c.a.split(), "agnostic" if c.a.startswith("full") else c.protocol)]
        b = by[(*c.b.split(), c.protocol)]
        want_kl = sum(x - y for x, y in zip(a.window_kl, b.window_kl)) / len(a.window_kl)
        want_acc = sum(x - y for x, y in zip(a.scores, b.scores)) / len(a.scores)
        assert c.d_kl.mean == pytest.approx(want_kl) and c.d_acc.mean == pytest.approx(want_acc)
        assert c.d_kl.n == len(a.window_kl) and c.d_acc.n == len(a.scores)
        assert c.bytes_ratio == pytest.approx(a.bytes_per_token / b.bytes_per_token)
    assert got[2].d_kl.mean < 0  # the full cache's KL (0) minus an eviction's
    table = format_comparisons(got)
    assert table.count("\n") == 1 + len(got) and "| full r0 | knorm r0.5 | agnostic |" in table


def test_comparison_sides_are_checked_against_the_run_before_anything_loads(monkeypatch, capsys):
    grid = [GridItem("snapkv", Budget(ratio=0.5)), GridItem("snapkv", Budget(ratio=0.9)), *GRID]
    assert parse_comparisons(None) == [] and parse_comparisons(" ") == []
    assert parse_comparisons("hqekv-2@2bits:kivi-2@0") == [(Side("hqekv-2", "2bits"), Side("kivi-2", "r0"))]
    for text, needle in [
        ("snapkv", "write A:B"),
        ("a:b:c", "write A:B"),
        (":full", "names no method"),
        ("knorm@:full", "empty budget"),
        ("knorm@2:full", "ratio"),
        ("full:full", "both sides"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_comparisons(text)
    for text, needle in [
        ("nope:full", "'nope' is not among the run's methods"),
        ("snapkv:full", "runs at \\['r0.5', 'r0.9'\\]; name one"),
        ("snapkv@0.75:full", "snapkv@r0.75 is not run"),
    ]:
        with pytest.raises(ValueError, match=needle):
            validate_comparisons(parse_comparisons(text), grid)
    validate_comparisons(parse_comparisons("snapkv@0.9:knorm,full:snapkv@0.5"), grid)
    matched = [GridItem("knorm", None, parse_budgets("4096bpt")[0]), GridItem("knorm", Budget(ratio=0.5))]
    validate_comparisons(parse_comparisons("knorm@4096bpt:knorm@0.5"), matched)
    with pytest.raises(ValueError, match="knorm@2048bpt is not run"):
        validate_comparisons(parse_comparisons("knorm@2048bpt:full"), matched)

    import kvbench.models

    monkeypatch.setattr(kvbench.models, "load_smollm2", lambda *a, **k: pytest.fail("loaded the model"))
    for argv in (["--compare", "knorm:nope"], ["--compare", "snapkv:full", "--methods", "snapkv"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvbench: error: --compare") and err.count("\n") == 1


def test_reports_carry_the_comparisons_and_fast_tier_bytes(tmp_path):
    rows = [
        Row("full", "r0", scores=[1.0] * 12, window_kl=[0.0] * 12, bytes_per_token=2000.0),
        Row("x", "r0.9", scores=[0.0] * 12, window_kl=[0.1] * 12, bytes_per_token=1500.0),
        Row("y", "r0.9", scores=[1.0] * 12, window_kl=[0.2] * 12, bytes_per_token=200.0),
    ]
    assert "resident B/token" not in format_table(rows)  # nothing offloads: no extra column
    rows[1].resident_bytes_per_token = 200.0  # x offloads 1300 of its 1500 bytes per token
    table = format_table(rows)
    assert "resident B/token" in table and "| x | r0.9 | 1500 | 200 |" in table and "| y | r0.9 | 200 | 200 |" in table
    got = compare_rows(rows, parse_comparisons("x:y"))
    assert got[0].bytes_ratio == 1.0  # equal in the fast tier, which is what a budget is charged for
    rows[2].matched = {"target_bytes_per_token": 200.0, "calibration": 201.0}  # y ran at a bytes target
    assert compare_rows(rows, parse_comparisons("x:y@200bpt"))[0].b == "y r0.9"
    assert compare_rows(rows, parse_comparisons("x:y@300bpt")) == []
    assert got[0].d_acc.mean == -1.0 and got[0].d_acc.significant and got[0].d_kl.mean == pytest.approx(-0.1)
    write_json(rows, tmp_path / "r.json", {"command": "kvbench"}, got)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["comparisons"][0]["a"] == "x r0.9" and data["comparisons"][0]["bytes_ratio"] == 1.0
    assert data["results"][1]["resident_bytes_per_token"] == 200.0
    md = markdown_report(rows, {"command": "kvbench"}, [], got)
    assert "Head-to-head" in md and format_comparisons(got) in md
    assert "Head-to-head" not in markdown_report(rows, {"command": "kvbench"}, [])


def test_rows_record_the_fast_tier_bytes_of_every_cache():
    """Stores that offload nothing hold everything in the fast tier: resident bytes equal bytes."""
    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    rows = run_grid(model, tok, registry, GRID, work, progress=False)
    assert all(r.resident_bytes_per_token == pytest.approx(r.bytes_per_token, rel=0, abs=0) for r in rows)
    assert all(r.resident_bytes_per_token > 0 for r in rows)


def test_recorded_commands_name_no_local_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    inside, outside = str(tmp_path / "results" / "run1"), str(Path("/", "elsewhere", "runs", "run2"))
    assert cli.portable_argv(["--out", inside, "--profile", "paper"]) == ["--out", "results/run1", "--profile", "paper"]
    assert cli.portable_argv([f"--out={outside}"]) == ["--out=run2"]
    assert cli.portable_argv(["--out", "rel/x", "--methods", "a"]) == ["--out", "rel/x", "--methods", "a"]


def test_a_cell_computed_by_other_code_is_recomputed(tmp_path, monkeypatch):
    """Cells are keyed on a fingerprint of the code that computes them (the method's package and the evaluation
    modules): after an edit, a rerun recomputes instead of reusing a stale result; unchanged code reuses it."""
    import kvbench.run as run_mod
    from kvbench.cells import code_fingerprint

    model, tok, registry, work = tiny_model(), CharTokenizer(), discover(), workload()
    first = Recording(tmp_path, {"work": work.fingerprint()})
    run_grid(model, tok, registry, GRID[:1], work, cache=first, progress=False)
    assert first.puts == 2 + 2
    same = Recording(tmp_path, {"work": work.fingerprint()})
    run_grid(model, tok, registry, GRID[:1], work, cache=same, progress=False)
    assert same.puts == 0
    real = run_mod.code_fingerprint  # as if a file of kv_baselines (the method's package) had changed:
    monkeypatch.setattr(run_mod, "code_fingerprint", lambda mods: real(mods) + ("!" if "kv_baselines" in mods else ""))
    after = Recording(tmp_path, {"work": work.fingerprint()})
    run_grid(model, tok, registry, GRID[:1], work, cache=after, progress=False)
    assert after.puts == 2 + 2  # streaming_llm and the full cache live in kv_baselines: every cell again
    # a method composed from another package's registered base depends on both (hubkv-snapkv: kv_hubkv and the
    # snapkv of kv_baselines, which kv_hubkv never imports), found from the built compressor
    seen: list = []
    monkeypatch.setattr(run_mod, "code_fingerprint", lambda mods: seen.append(sorted(mods)) or "x")
    run_mod.method_code(registry["hubkv-snapkv"])
    assert {"kv_hubkv", "kv_baselines", "kvcore", "kv_hf", "kvbench.run"} <= set(seen[-1])
    run_mod.method_code(registry["streaming_llm"])
    assert "kv_baselines" in seen[-1] and "kv_hubkv" not in seen[-1]
    # the fingerprint follows the files: an edited module gives another value, the same sources the same value
    pkg = tmp_path / "fp_pkg_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kvbench.cells as cells_mod

    a = code_fingerprint(["fp_pkg_probe"])
    cells_mod._source_digest.cache_clear()
    assert code_fingerprint(["fp_pkg_probe"]) == a
    (pkg / "__init__.py").write_text("x = 2\n")
    cells_mod._source_digest.cache_clear()
    assert code_fingerprint(["fp_pkg_probe"]) != a
    assert code_fingerprint(["no_such_module_anywhere"]) != a


def test_an_edit_during_a_run_is_reported(tmp_path, monkeypatch):
    """``code_changed`` reads the sources again: a method whose package changed since the run started is named
    (the CLI warns and records it in ``meta.code_changed_during_run``), an unchanged one is not."""
    from kvbench.run import code_changed, method_code

    pkg = tmp_path / "fp_edit_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from kvcore.registry import Method\n"
        "def make(budget):\n"
        "    import kv_baselines\n"
        "    return kv_baselines.streaming_llm(budget.ratio)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import fp_edit_probe

    registry = discover()
    registry["probe"] = Method("probe", fp_edit_probe.make, "a method defined in a package this test edits")
    before = {name: method_code(registry[name]) for name in ("probe", "streaming_llm")}
    assert code_changed(registry, before) == []
    (pkg / "__init__.py").write_text((pkg / "__init__.py").read_text() + "# edited\n")
    assert code_changed(registry, before) == ["probe"]
