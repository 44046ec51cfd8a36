"""The model registry and the CLI's --model / --list-models, without loading a real model."""

from __future__ import annotations

import pytest

import kvbench.models
from kvbench import cli
from kvbench.models import DEFAULT_MODEL, MODELS, describe_models, get_model


def test_registry_names_both_models_with_their_loaders():
    assert list(MODELS) == ["smollm2-135m", "gemma3-270m"]
    assert DEFAULT_MODEL == "smollm2-135m"
    assert get_model("smollm2-135m").loader == "load_smollm2"
    assert get_model("gemma3-270m").loader == "load_gemma3_270m"
    for entry in MODELS.values():
        assert callable(getattr(kvbench.models, entry.loader)), entry
        assert entry.description and "\n" not in entry.description
    # the default keeps the names earlier results (and their cell caches) were recorded under
    assert (get_model(DEFAULT_MODEL).title, get_model(DEFAULT_MODEL).short) == ("SmolLM2-135M-Instruct", "SmolLM2-135M")


def test_unknown_model_is_a_one_line_value_error():
    for bad in ("gemma3", "", None, 3):
        with pytest.raises(ValueError, match="known: smollm2-135m, gemma3-270m") as exc:
            get_model(bad)
        assert "\n" not in str(exc.value)


def test_entry_load_calls_the_loader_by_name(monkeypatch):
    seen = []
    monkeypatch.setattr(kvbench.models, "load_gemma3_270m", lambda **kw: seen.append(kw) or ("m", "t"))
    assert get_model("gemma3-270m").load(device="cpu") == ("m", "t")
    assert seen == [{"device": "cpu"}]


def test_list_models_prints_one_line_each_without_loading(monkeypatch, capsys):
    for entry in MODELS.values():
        monkeypatch.setattr(kvbench.models, entry.loader, lambda *a, **k: pytest.fail("loaded a model"))
    assert cli.main(["--list-models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == describe_models().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("smollm2-135m (default)") and lines[1].startswith("gemma3-270m ")


def test_unknown_model_is_a_cli_error_before_any_model_work(monkeypatch, capsys):
    for entry in MODELS.values():
        monkeypatch.setattr(kvbench.models, entry.loader, lambda *a, **k: pytest.fail("loaded a model"))
    assert cli.main(["--model", "llama-7b"]) == 2
    err = capsys.readouterr().err
    assert err == "kvbench: error: --model: unknown model 'llama-7b'; known: smollm2-135m, gemma3-270m\n"


def test_model_option_picks_the_loader(monkeypatch, tmp_path):
    class Picked(Exception):
        pass

    calls = []

    def gemma(**kw):
        calls.append(kw)
        raise Picked

    monkeypatch.setattr(kvbench.models, "load_smollm2", lambda *a, **k: pytest.fail("loaded the default model"))
    monkeypatch.setattr(kvbench.models, "load_gemma3_270m", gemma)
    with pytest.raises(Picked):
        cli.main(["--model", "gemma3-270m", "--device", "cpu", "--out", str(tmp_path), "--no-progress"])
    assert calls and calls[0]["device"] == "cpu"
    assert cli.parse_args([]).model == DEFAULT_MODEL
