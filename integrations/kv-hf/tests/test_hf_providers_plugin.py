"""Extras providers from installed packages (the ``kvcompress.hf_providers`` entry-point group): a method package
ships the provider its scorer needs, kv-hf runs it with no change of its own; broken plugins are skipped."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from kvhf_testkit import make, prompt, tiny_model

import kv_hf
from kv_hf import providers
from kvcore import Scorer, Scores


@dataclass(frozen=True)
class PositionScorer(Scorer):
    """Reads an extra no built-in provider supplies: a per-token score computed from the model by a plugin."""

    needs_extras: ClassVar[frozenset[str]] = frozenset({"token_position_score"})

    def score(self, ctx):
        return Scores(ctx.extras["token_position_score"].to(ctx.keys.device))


def _run(model, cache, input_ids, *, tokenizer, context_start, config):
    """Score each collected token by its position (a stand-in for a model pass), per layer."""
    T = input_ids.shape[1]
    B, H = input_ids.shape[0], model.config.num_key_value_heads
    scores = torch.arange(T, dtype=torch.float32).expand(B, H, T).clone()
    return {i: {"token_position_score": scores} for i in range(model.config.num_hidden_layers)}


PLUGIN = providers.Provider(
    name="token_position_score",
    option="position_score",
    check=lambda cache, input_ids, attention_mask, tokenizer: None,
    run=_run,
    description="a test plugin's per-token score",
)


class FakeEntryPoint:
    def __init__(self, name, value, obj=None, error=None):
        self.name, self.value, self._obj, self._error = name, value, obj, error

    def load(self):
        if self._error is not None:
            raise self._error
        return self._obj


@pytest.fixture
def plugins(monkeypatch):
    """Replace the installed entry points of the group; restore the registry afterwards."""
    saved = dict(providers.PROVIDERS)
    monkeypatch.setattr(providers, "_discovered", False)

    def install(*eps):
        monkeypatch.setattr(providers, "_entry_points", lambda: list(eps))

    yield install
    providers.PROVIDERS.clear()
    providers.PROVIDERS.update(saved)


@torch.no_grad()
def test_a_provider_from_an_entry_point_runs_in_prefill(plugins):
    plugins(FakeEntryPoint("token_position_score", "plugin.hf:PROVIDER", PLUGIN))
    assert "token_position_score" in providers.provided() and "position_score" in providers.options()
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(PositionScorer(), ratio=0.5))
    ids = prompt(16, seed=3)
    kv_hf.prefill(model, cache, ids, position_score=None)
    positions = cache.layers[0].store.read(None).positions  # the plugin's score keeps the later half
    assert sorted(positions[0, 0].tolist()) == list(range(8, 16))


def test_broken_or_misnamed_plugins_are_skipped_with_a_warning(plugins, caplog):
    plugins(
        FakeEntryPoint("broken", "plugin.broken:PROVIDER", error=ImportError("no module named plugin")),
        FakeEntryPoint("other_name", "plugin.hf:PROVIDER", PLUGIN),
        FakeEntryPoint("not_a_provider", "plugin.hf:thing", object()),
    )
    with caplog.at_level(logging.WARNING, logger="kv_hf.providers"):
        names = providers.provided()
    assert {"kvzip_scores", "surprisal"} <= names and not names & {"broken", "other_name", "not_a_provider"}
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "'broken'" in messages and "'other_name'" in messages and "'not_a_provider'" in messages


def test_register_refuses_a_second_provider_of_a_name():
    with pytest.raises(ValueError, match="'kvzip_scores' is already registered"):
        providers.register(providers.Provider("kvzip_scores", "x", PLUGIN.check, PLUGIN.run, "an impostor"))
    with pytest.raises(TypeError, match="provider must be a kv_hf.providers.Provider"):
        providers.register("kvzip_scores")
