"""``kvbench tune`` on tiny models: bad input refused in one line before any model work, the GGUF header reader, the
frontier / winner / ties, the winner's line of Python, and whole searches (a local transformers folder; resume;
``--budget-minutes``)."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

from kv_hf.testing import tiny_model
from kvbench import cli
from kvbench.report import Row
from kvbench.stats import bootstrap_mean
from kvbench.tune import frontier
from kvbench.tune.grid import Costs, candidates, estimate, floor_fraction, trim
from kvbench.tune.source import ModelSource, gguf_header, resolve_model

# the tiny models' windows are shorter than SnapKV's observation window at the high ratios a byte search tries:
# the compressor keeps the protected entries and says so (ShortInputWarning), which these tests expect
pytestmark = pytest.mark.filterwarnings("ignore::kvcore.ShortInputWarning")
from kvcore import Budget
from kvcore.registry import discover

WORDS = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(120))]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _text(path, words: int = 2000):
    rng = random.Random(0)
    path.write_text(" ".join(rng.choice(WORDS[3:]) for _ in range(words)))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to load weights fails the test."""

    def boom(*a, **k):
        raise AssertionError("no model may be loaded for a bad option")

    monkeypatch.setattr(ModelSource, "load", boom)


def _one_line_error(capsys, argv, needle):
    assert cli.main(["tune", *argv]) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvbench tune: error:") and needle in err, (argv, err)


def test_bad_input_is_one_line_before_any_model_work(tmp_path, capsys, no_model):
    text = _text(tmp_path / "t.txt")
    base = ["--text", str(text), "--windows", "2", "--context", "64", "--continuation", "8"]
    _one_line_error(capsys, [*base, "--target", "0.00001"], "below what any candidate can hold")
    _one_line_error(capsys, [*base, "--target", "0.25", "--methods", "snapkv,nope"], "--methods: unknown method")
    _one_line_error(capsys, [*base, "--target", "0.25", "--tasks", "bogus"], "--tasks: unknown task")
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3")
    _one_line_error(capsys, ["--text", str(short), "--target", "0.25"], "cannot hold 8 windows")
    _one_line_error(capsys, ["--text", str(tmp_path / "missing.txt"), "--target", "0.25"], "--text")
    _one_line_error(capsys, [*base, "--target", "0.25", "--model", str(tmp_path / "nothing")], "--model")
    for argv in (["--target", "1.5"], ["--target", "0.2", "--max-kl", "0.1"], []):  # argparse: exit 2, usage
        with pytest.raises(SystemExit) as exc:
            cli.main(["tune", *base, *argv])
        assert exc.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


def _gguf(path, arch: str, **ints):
    """A GGUF file holding only metadata: the architecture, ``ints`` (u32) and a string array (skipped)."""

    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x.encode())) + x.encode()

    kv = [s("general.architecture") + struct.pack("<I", 8) + s(arch)]
    kv.append(s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + s("a") + s("bc"))
    kv.append(s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2) + struct.pack("<ff", 0.5, 1.5))
    kv += [s(k) + struct.pack("<II", 4, v) for k, v in ints.items()]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))
    return path


def test_gguf_header_and_the_adapter_refusing_a_model(tmp_path, capsys, no_model):
    good = _gguf(tmp_path / "m.gguf", "llama", **{"llama.block_count": 4, "llama.attention.head_count": 4})
    with good.open("rb") as f:
        header = gguf_header(f)
    assert header == {"general.architecture": "llama", "llama.block_count": 4, "llama.attention.head_count": 4}
    src = resolve_model(str(good))
    assert src.kind == "gguf" and src.fp16_bytes_per_token is None  # no head size in this header
    text = _text(tmp_path / "t.txt")
    base = ["--text", str(text), "--windows", "2", "--context", "64", "--target", "0.25"]
    bad = _gguf(tmp_path / "gpt.gguf", "gpt2")
    _one_line_error(capsys, [*base, "--model", str(bad)], "adapter refuses this model")
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    _one_line_error(capsys, [*base, "--model", str(tmp_path / "junk.bin")], "is not a GGUF file")
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "gpt2")
    _one_line_error(capsys, [*base, "--model", str(tmp_path / "gpt2")], "adapter refuses this model")
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, [*base, "--model", str(tmp_path / "empty")], "no config.json")


def test_target_bytes_checked_against_the_models_cache(tmp_path, capsys, no_model):
    folder = tmp_path / "llama"
    tiny_model().config.save_pretrained(folder)  # 2 layers x 2 KV heads x 16: 256 B/token in fp16
    assert resolve_model(str(folder)).fp16_bytes_per_token == 256
    base = ["--text", str(_text(tmp_path / "t.txt")), "--windows", "2", "--context", "64", "--model", str(folder)]
    _one_line_error(capsys, [*base, "--target-bytes", "300"], "nothing to compress")
    _one_line_error(capsys, [*base, "--target-bytes", "0.001"], "below what any candidate can hold")


def test_candidates_skip_ablations_and_the_reference():
    registry = discover()
    names = candidates(registry, None)
    assert "full" not in names and "snapkv" in names and "hubkv-snapkv" in names and "hqekv-2" in names
    assert not any("ablation" in registry[n].description.lower() for n in names)
    assert candidates(registry, "full,knorm") == ["knorm"]
    with pytest.raises(ValueError, match="besides the full cache"):
        candidates(registry, "full")
    assert floor_fraction(registry["hqekv-2"], 512) == pytest.approx(2.0 / 16)  # a fixed budget: its average bits


def test_the_floor_holds_an_evicting_methods_window_at_the_models_dtype(tmp_path, capsys, no_model):
    """Invariant: SnapKV keeps its 64-token observation window at full precision whatever its ratio, so on 256-token
    windows it holds at least 64/256 of the cache: 0.25 of an fp16 cache in bf16, 0.5 in float32 (twice the bytes);
    a quantizing store's floor is its narrowest width (KIVI-2: 2 bits per protected entry)."""
    registry = discover()
    assert floor_fraction(registry["snapkv"], 256, 2.0) == pytest.approx(64 / 256)
    assert floor_fraction(registry["snapkv"], 256, 4.0) == pytest.approx(2 * 64 / 256)
    assert floor_fraction(registry["kivi-2"], 256, 4.0) <= 64 / 256 * 2 / 16 + 1e-12
    base = ["--text", str(_text(tmp_path / "t.txt")), "--windows", "2", "--context", "256", "--methods", "snapkv"]
    _one_line_error(capsys, [*base, "--target", "0.4", "--dtype", "float32"], "below what any candidate can hold")


def test_trim_drops_the_most_expensive_cells_first():
    from kvbench.methods import GridItem

    items = [GridItem("a", Budget(ratio=0.5)), GridItem("b", None), GridItem("c", Budget(ratio=0.5))]
    costs = Costs(0.1, 0.1, 0.01, {"a": 0.1, "b": 1.0, "c": 0.2})
    total = estimate(items, costs, 4, 0)
    kept, dropped = trim(items, costs, 4, 0, total)
    assert kept == items and dropped == []
    kept, dropped = trim(items, costs, 4, 0, total - 1)
    assert [i.name for i in dropped] == ["b"] and [i.name for i in kept] == ["a", "c"]
    assert trim(items, costs, 4, 0, 0.0)[0] == []
    done = {id(items[1]): (0.0, False)}  # b finished in an earlier run: it costs nothing and stays
    assert estimate(items, costs, 4, 0, done) < total
    assert trim(items, costs, 4, 0, estimate(items, costs, 4, 0, done), done) == (items, [])
    assert estimate(items, costs, 4, 0, {id(i): (0.0, False) for i in items}) == 0.0


def _row(method, budget, bpt, kl, fp16=1000.0):
    r = Row(method, budget, window_kl=list(kl), kl=sum(kl) / len(kl))
    r.bytes_per_token = r.resident_bytes_per_token = bpt
    r.fp16_fraction = bpt / fp16
    r.kl_ci = bootstrap_mean(r.window_kl)
    return r


def test_winner_ties_frontier_and_the_line_of_python():
    n = 12
    full = _row("full", "r0", 1000, [0.0] * n)
    a = _row("snapkv", "r0.75", 250, [0.10 + 0.01 * (i % 3) for i in range(n)])
    b = _row("knorm", "r0.75", 250, [0.11 + 0.01 * (i % 2) for i in range(n)])  # close to a: a tie
    c = _row("streaming_llm", "r0.75", 250, [0.5 + 0.01 * i for i in range(n)])  # clearly worse
    d = _row("hqekv-2", "2bits", 400, [0.01] * n)  # better but over the target
    rows = [full, a, b, c, d]
    choice = frontier.choose_at_target(rows, 250, 0.05)
    assert choice.winner is a and choice.ties == [b] and d not in choice.qualified
    assert [r.method for r in frontier.pareto(rows)] == ["snapkv", "hqekv-2", "full"]
    assert frontier.choose_at_target(rows, 100, 0.05).winner is None
    small = frontier.choose_smallest(rows, 0.2)
    assert small.winner in (a, b) and frontier.choose_smallest(rows, 0.001).winner is None
    assert frontier.registry_spec(a, False) == "snapkv@0.75" and frontier.registry_spec(d, True) == "hqekv-2"
    line = frontier.python_line(a, False)
    assert line == "cache = kv_hf.compressed_cache(model, kvcore.registry.build('snapkv', kvcore.Budget(ratio=0.75)))"
    import kv_hf
    import kvcore
    import kvcore.registry

    scope = {"kv_hf": kv_hf, "kvcore": kvcore, "model": tiny_model()}
    for row, fixed in ((a, False), (d, True)):
        exec(frontier.python_line(row, fixed), scope)
        assert isinstance(scope["cache"], kv_hf.CompressedCache)


def test_a_search_on_a_local_folder_resumes_and_trims(tmp_path, capsys):
    folder = tmp_path / "llama"
    model = tiny_model()
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    text = _text(tmp_path / "t.txt")
    out = tmp_path / "out"
    argv = ["tune", "--model", str(folder), "--text", str(text), "--windows", "3", "--context", "48"]
    argv += ["--continuation", "6", "--target", "0.5", "--methods", "snapkv,knorm,kivi-2,kcvt-4"]
    argv += ["--out", str(out), "--no-progress", "--seed", "1"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "estimated" in captured.err and "Recommendation for" in captured.out
    meta = json.loads((out / "tune.json").read_text())["meta"]
    assert meta["winner"] and meta["spec"] and meta["python"].startswith("cache = kv_hf.compressed_cache(model, ")
    assert meta["cells_reused"] == 0 and (out / "tune.png").stat().st_size > 0
    results = json.loads((out / "tune.json").read_text())["results"]
    assert all(r["decode_tok_s"] for r in results if not r["error"])
    assert cli.main(argv) == 0  # a second run reuses every cell, and knows it has nothing left to do
    second = json.loads((out / "tune.json").read_text())["meta"]
    assert second["cells_reused"] > 0 and second["estimate_s"] == 0.0 and second["winner"] == meta["winner"]
    capsys.readouterr()
    assert cli.main([*argv, "--budget-minutes", "0.0001", "--out", str(tmp_path / "o2")]) == 2
    assert "even the cheapest cell does not fit" in capsys.readouterr().err


def test_budget_minutes_drops_cells_and_says_so(tmp_path, capsys, monkeypatch):
    import kvbench.tune.grid as grid

    monkeypatch.setattr(ModelSource, "load", lambda self, dtype, device: (tiny_model(), _tokenizer()))
    monkeypatch.setattr(
        grid, "measure_costs", lambda m, t, r, names, w, progress: Costs(0.01, 0.01, 0.001, {n: 1.0 for n in names})
    )
    text = _text(tmp_path / "t.txt")
    argv = ["tune", "--text", str(text), "--windows", "2", "--context", "40", "--continuation", "4"]
    argv += ["--target", "0.5", "--methods", "snapkv,knorm", "--out", str(tmp_path / "o"), "--no-progress"]
    argv += ["--budget-minutes", str(15 / 60)]  # two searches of ~10 s each and the shared passes: one fits
    assert cli.main(argv) in (0, 1)
    err = capsys.readouterr().err
    assert "longer than --budget-minutes" in err
    meta = json.loads((tmp_path / "o" / "tune.json").read_text())["meta"]
    assert len(meta["dropped"]) == 1 and meta["methods"] == ["snapkv", "knorm"]


def test_help_runs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "--help"])
    assert "--budget-minutes" in capsys.readouterr().out
    assert torch.__version__


def test_a_target_under_the_sliding_window_layers_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    from kv_hf.support import text_config
    from kvbench.tune.grid import window_fraction

    gemma = tiny_model("gemma3", sliding_window=16)  # every other layer keeps its last 15 tokens
    assert window_fraction(text_config(gemma), 60, 4) == pytest.approx(0.5 * 15 / 60 * 2)
    assert window_fraction(text_config(tiny_model()), 60, 2) == 0.0

    def no_search(*a, **k):
        raise AssertionError("the search must not start")

    monkeypatch.setattr(ModelSource, "load", lambda self, dtype, device: (gemma, _tokenizer()))
    monkeypatch.setattr("kvbench.tune.grid.measure_costs", no_search)
    argv = ["--text", str(_text(tmp_path / "t.txt")), "--windows", "2", "--context", "60", "--continuation", "4"]
    _one_line_error(capsys, [*argv, "--target", "0.2", "--methods", "kivi-2"], "sliding-window layers")
