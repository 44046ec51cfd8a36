"""Bad arguments raise clear errors naming the argument and its allowed range."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kv_hubkv import HubKVConfig, refine
from kvcore import Budget, Compressor, DenseStore, Scorer, Scores, ScoringContext, TopKSelector

S = torch.rand(2, 3, 16)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"gamma": 0.0}, ValueError, r"gamma.*\(0, 1\)"),
        ({"gamma": 1.0}, ValueError, r"gamma.*\(0, 1\)"),
        ({"gamma": -0.5}, ValueError, r"gamma"),
        ({"gamma": math.nan}, ValueError, r"gamma.*finite"),
        ({"gamma": "0.5"}, TypeError, r"gamma"),
        ({"kernel_size": 4}, ValueError, r"kernel_size.*odd"),
        ({"kernel_size": 0}, ValueError, r"kernel_size.*>= 1"),
        ({"kernel_size": -3}, ValueError, r"kernel_size"),
        ({"kernel_size": 5.0}, TypeError, r"kernel_size.*int"),
        ({"kernel_size": True}, TypeError, r"kernel_size"),
        ({"beta_min": 1.3, "beta_max": 1.2}, ValueError, r"beta_min.*<= beta_max"),
        ({"beta_min": 0.0}, ValueError, r"beta_min.*> 0"),
        ({"beta_max": math.inf}, ValueError, r"beta_max.*finite"),
        ({"tau": -1.0}, ValueError, r"tau.*>= 0"),
        ({"p": 0.0}, ValueError, r"p .*> 0"),
        ({"eps": 0.0}, ValueError, r"eps.*> 0"),
    ],
)
def test_bad_hyper_parameters(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        refine(S, 0.5, **kwargs)
    with pytest.raises(exc, match=match):
        HubKVConfig(**kwargs)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_ratio_outside_unit_interval(ratio):
    with pytest.raises(ValueError, match=r"ratio.*\[0, 1\)"):
        refine(S, ratio)


@pytest.mark.parametrize("ratio", ["0.5", None, True])
def test_ratio_wrong_type(ratio):
    with pytest.raises(TypeError, match="ratio"):
        refine(S, ratio)


def test_scores_type_dtype_rank():
    with pytest.raises(TypeError, match="scores.*torch.Tensor"):
        refine([[0.1, 0.2]], 0.5)
    with pytest.raises(TypeError, match="scores.*floating"):
        refine(torch.ones(2, 4, dtype=torch.int64), 0.5)
    with pytest.raises(TypeError, match="scores.*floating"):
        refine(torch.ones(2, 4, dtype=torch.bool), 0.5)
    with pytest.raises(ValueError, match=r"scores.*\[\.\.\., H, N\]"):
        refine(torch.rand(8), 0.5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_scores(bad):
    s = S.clone()
    s[1, 2, 3] = bad
    with pytest.raises(ValueError, match="finite"):
        refine(s, 0.5)


def test_negative_unprotected_scores_rejected_but_protected_allowed():
    s = S.clone()
    s[0, 0, 0] = -0.1
    with pytest.raises(ValueError, match=">= 0"):
        refine(s, 0.5)
    prot = torch.zeros(16, dtype=torch.bool)
    prot[0] = True
    out = refine(s, 0.5, prot)  # the negative score is protected: overwritten, fine
    assert float(out[0, 0, 0]) >= 1.0


def test_protected_type_and_shape():
    with pytest.raises(TypeError, match="protected.*bool"):
        refine(S, 0.5, torch.zeros(2, 3, 16))
    with pytest.raises(TypeError, match="protected"):
        refine(S, 0.5, [[True]])
    with pytest.raises(ValueError, match="protected shape"):
        refine(S, 0.5, torch.zeros(2, 3, 15, dtype=torch.bool))
    with pytest.raises(ValueError, match="protected shape"):  # would enlarge scores
        refine(S, 0.5, torch.zeros(4, 2, 3, 16, dtype=torch.bool))
    # broadcastable shapes are accepted
    for shape in [(16,), (1, 16), (2, 1, 16), (3, 16)]:
        refine(S, 0.5, torch.zeros(shape, dtype=torch.bool))


def test_config_fields_are_normalised_and_frozen():
    cfg = HubKVConfig(gamma=1 / 4, tau=1, p=3)
    assert isinstance(cfg.tau, float) and isinstance(cfg.p, float)
    assert cfg.half_window == 2
    assert cfg.gate(0.5) == 0.5**3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gamma = 0.9  # type: ignore[misc]


class _NegNorm(Scorer):
    def score(self, ctx):
        return Scores(-ctx.keys.float().norm(dim=-1))


def test_scoring_a_batch_of_zero_rows_is_refused_by_name():
    from kv_hubkv import hubkv

    compressor = hubkv(Compressor(_NegNorm(), TopKSelector(), DenseStore, Budget(0.5)))
    k = torch.randn(0, 2, 16, 8)
    with pytest.raises(ValueError, match="batch size 0"):  # was an IndexError from inside the refinement
        compressor.scorer.score(ScoringContext(keys=k, values=k, budget=Budget(0.5)))
    with pytest.raises(ValueError, match="batch size 0"):
        compressor.compress(ScoringContext(keys=k, values=k))
    with pytest.raises(TypeError, match="ctx"):
        compressor.scorer.score(k)
