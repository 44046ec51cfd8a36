"""Unsupported combinations raise errors that name what is missing."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from kvhf_testkit import TINY, KnormScorer, WindowScorer, full_compressor, make, prompt, tiny_model
from transformers import GPT2Config, GPT2LMHeadModel

import kv_baselines
import kv_hf
from kvcore import Scorer, Scores


@dataclass(frozen=True)
class SurprisalScorer(Scorer):  # reads an extra no kv_hf provider supplies
    needs_extras: ClassVar[frozenset] = frozenset({"hidden_states"})

    def score(self, ctx):
        return Scores(ctx.extras["hidden_states"][:, None].expand(ctx.keys.shape[:3]).float())


def test_unsupported_architecture():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(ValueError, match="model types .*'gpt2'"):
        kv_hf.compressed_cache(model, full_compressor())
    with pytest.raises(TypeError, match="PreTrainedModel"):
        kv_hf.compressed_cache(object(), full_compressor())


def test_layers_kv_hf_cannot_serve_are_refused_naming_the_layer():
    with pytest.raises(ValueError, match="sliding_window=4096"):  # a window on every layer: nothing global
        kv_hf.compressed_cache(tiny_model("mistral", sliding_window=4096), full_compressor())
    only_windows = tiny_model("gemma3", layer_types=["sliding_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="every layer of this model is sliding-window attention"):
        kv_hf.compressed_cache(only_windows, full_compressor())
    model = tiny_model("gemma3")
    model.config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="layer 1 is 'chunked_attention' attention"):
        kv_hf.compressed_cache(model, full_compressor())


def test_flash_attention_is_refused():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # what from_pretrained(attn_implementation=...) sets
    with pytest.raises(ValueError, match="flash_attention_2"):
        kv_hf.compressed_cache(model, full_compressor())
    with pytest.raises(ValueError, match="per-head logit bias"):
        kv_hf.enable_attention(model)


def test_scorer_needs_the_adapter_cannot_supply():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"needs extras \['hidden_states'\]"):
        kv_hf.compressed_cache(model, make(SurprisalScorer()))
    with pytest.raises(ValueError, match="query_window >= 1"):
        kv_hf.compressed_cache(model, make(WindowScorer()), query_window=0)
    with pytest.raises(ValueError, match="no extras are available while decoding"):
        kv_hf.compressed_cache(
            model,
            make(KnormScorer()),
            recompress_every=4,
            target_length=4,
            recompressor=kv_baselines.kvzip(granularity="head"),
        )
    with pytest.raises(TypeError, match="kvcore.Compressor"):
        kv_hf.compressed_cache(model, KnormScorer())


def test_bad_options():
    model = tiny_model("llama")
    comp = make(KnormScorer())
    with pytest.raises(TypeError, match="unknown compressed_cache options"):
        kv_hf.compressed_cache(model, comp, window=3)
    with pytest.raises(ValueError, match="needs a target"):
        kv_hf.compressed_cache(model, comp, recompress_every=4)
    with pytest.raises(ValueError, match="not both"):
        kv_hf.compressed_cache(model, comp, target_length=4, target_ratio=0.5)
    with pytest.raises(ValueError, match=r"target_ratio must be in \[0, 1\)"):
        kv_hf.compressed_cache(model, comp, target_ratio=1.0)
    with pytest.raises(ValueError, match="'global' is not supported"):
        kv_hf.compressed_cache(model, make(KnormScorer(), granularity="global"), recompress_every=2, target_length=3)
    with pytest.raises(ValueError, match="query_window must be an int >= 0"):
        kv_hf.compressed_cache(model, comp, query_window=-1)


@torch.no_grad()
def test_switching_attention_away_is_detected():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer()))
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="'kv_hf' or 'kv_hf_eager'"):
        model(prompt(8), past_key_values=cache)


@torch.no_grad()
def test_padding_after_compression_and_uneven_rollback_are_refused():
    model = tiny_model("llama")
    ids = prompt(10, B=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cache = kv_hf.compressed_cache(model, make(KnormScorer()))
    model(ids, attention_mask=mask, past_key_values=cache, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    assert cache.next_positions().tolist() == [7, 10]
    with pytest.raises(ValueError, match="different left padding"):
        cache.rollback(5)
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(3)
    q = prompt(3, B=2, seed=9)
    qmask = torch.cat([mask, torch.tensor([[0, 1, 1], [1, 1, 1]])], 1)
    with pytest.raises(ValueError, match="padding inside a multi-token step"):
        model(q, attention_mask=qmask, past_key_values=cache, position_ids=torch.tensor([[7, 7, 8], [10, 11, 12]]))


@torch.no_grad()
def test_rollback_refused_when_recompression_may_prune_the_context():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer()), recompress_every=2, target_length=3)
    kv_hf.prefill(model, cache, prompt(10))
    with pytest.raises(ValueError, match="recompress_every"):
        kv_hf.generate_answer(model, cache, prompt(2), max_new_tokens=2)


def test_tiny_config_is_what_the_tests_claim():
    assert TINY["num_hidden_layers"] == 2 and TINY["num_attention_heads"] == 4 and TINY["num_key_value_heads"] == 2


def test_bad_beam_indices_are_refused_and_change_nothing():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, full_compressor())
    with torch.no_grad():
        model(prompt(6, B=2), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    view = layer.store.read()
    sizes = [lay.nbytes() for lay in cache.layers]
    bad = {
        "a float index (used to be truncated)": (
            TypeError,
            "beam_idx",
            lambda: cache.reorder_cache(torch.tensor([1.7, 0.2])),
        ),
        "a row out of range": (ValueError, "beam_idx", lambda: cache.reorder_cache(torch.tensor([0, 2]))),
        "a negative row": (ValueError, "beam_idx", lambda: cache.reorder_cache(torch.tensor([-1, 0]))),
        "float indices": (TypeError, "indices", lambda: cache.batch_select_indices(torch.tensor([0.5]))),
        "a str": (TypeError, "indices", lambda: cache.batch_select_indices("0")),
    }
    for what, (error, name, call) in bad.items():
        with pytest.raises(error, match=name):
            call()
            pytest.fail(f"accepted {what}")
        assert [lay.nbytes() for lay in cache.layers] == sizes, f"{what} changed the cache"
        now = layer.store.read()
        assert torch.equal(now.keys, view.keys) and torch.equal(now.positions, view.positions), what
    cache.reorder_cache(torch.tensor([1, 1]))  # a valid beam reorder still works
    assert torch.equal(layer.store.read().keys[0], view.keys[1])
