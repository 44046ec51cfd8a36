"""Compressor factories reject arguments of the wrong type or range when called, naming the argument (not at the
first compress, and never by truncating a float)."""

import pytest

import kv_baselines as kb

BAD = {
    "random seed str": (TypeError, "seed", lambda: kb.random(0.5, seed="x")),
    "random seed float": (TypeError, "seed", lambda: kb.random(0.5, seed=1.5)),
    "random seed bool": (TypeError, "seed", lambda: kb.random(0.5, seed=True)),
    "random seed negative": (ValueError, "seed", lambda: kb.random(0.5, seed=-1)),
    "random ratio str": (TypeError, "ratio", lambda: kb.random("0.5")),
    "knorm ratio 1": (ValueError, "ratio", lambda: kb.knorm(1.0)),
    "snapkv window 0": (ValueError, "window", lambda: kb.snapkv(0.5, window=0)),
    "snapkv window float": (TypeError, "window", lambda: kb.snapkv(0.5, window=2.0)),
    "snapkv kernel_size float": (TypeError, "kernel_size", lambda: kb.snapkv(0.5, kernel_size=3.0)),
    "snapkv kernel_size even": (ValueError, "kernel_size", lambda: kb.snapkv(0.5, kernel_size=4)),
    "streaming_llm n_sink float": (TypeError, "n_sink", lambda: kb.streaming_llm(0.5, n_sink=1.5)),
    "streaming_llm n_sink negative": (ValueError, "n_sink", lambda: kb.streaming_llm(0.5, n_sink=-1)),
    "h2o recent str": (TypeError, "recent", lambda: kb.h2o(0.5, recent="x")),
    "kivi group_size 0": (ValueError, "group_size", lambda: kb.kivi(2, group_size=0)),
    "kivi residual not a multiple": (ValueError, "residual", lambda: kb.kivi(2, group_size=32, residual=48)),
    "kvzip ratio str": (TypeError, "ratio", lambda: kb.kvzip("0.5")),
    "expected_attention n_future_positions 0": (
        ValueError,
        "n_future_positions",
        lambda: kb.expected_attention(0.5, n_future_positions=0),
    ),
    "expected_attention n_sink float": (TypeError, "n_sink", lambda: kb.expected_attention(0.5, n_sink=2.0)),
    "expected_attention ratio 1": (ValueError, "ratio", lambda: kb.expected_attention(1.0)),
    "sentencekv sinks negative": (ValueError, "sinks", lambda: kb.sentencekv(0.5, sinks=-1)),
    "sentencekv semantic_factor str": (TypeError, "semantic_factor", lambda: kb.sentencekv(0.5, semantic_factor="5")),
    "sentencekv window 0": (ValueError, "window", lambda: kb.sentencekv(0.5, window=0)),
    "pyramidkv beta below 1": (ValueError, "beta", lambda: kb.pyramidkv(0.5, beta=0.5)),
    "pyramidkv window 0": (ValueError, "window", lambda: kb.pyramidkv(0.5, window=0)),
    "pyramidkv kernel_size even": (ValueError, "kernel_size", lambda: kb.pyramidkv(0.5, kernel_size=4)),
}


@pytest.mark.parametrize("what", list(BAD))
def test_factory_rejects_bad_arguments(what):
    error, name, call = BAD[what]
    with pytest.raises(error, match=name):
        call()


def test_valid_arguments_still_build():
    assert kb.random(0.5, seed=3).scorer.seed == 3
    assert kb.snapkv(0.5, window=8, kernel_size=3).scorer.window == 8
    assert kb.kivi(2, group_size=16, residual=32).new_store().residual == 32


@pytest.mark.parametrize(
    ("kw", "err"),
    [
        ({"bits": 5}, ValueError),
        ({"bits": 16}, ValueError),
        ({"bits": 2.0}, TypeError),
        ({"value_bits": 6}, ValueError),
    ],
)
def test_kivi_takes_kivi_widths_only(kw, err):
    with pytest.raises(err, match="bits"):
        kb.kivi(**kw)
