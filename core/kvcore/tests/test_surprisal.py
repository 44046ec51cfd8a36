"""kvcore's definition of the ``"surprisal"`` extra (SEKV §3.1, Eq. 1): the chunked reference equals the full
log-softmax for any chunk, the padding rule, non-negativity, and argument errors that name the argument."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.surprisal import token_surprisal


def _case(B=2, T=9, D=6, V=23, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    b = 2 * torch.randn(V, generator=g) if bias else None
    return hidden, weight, b, torch.randint(0, V, (B, T), generator=g)


def _full(hidden, weight, b, ids):
    logits = hidden @ weight.T + (0 if b is None else b)
    want = torch.zeros(ids.shape)
    want[:, 1:] = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return want


@settings(max_examples=25, deadline=None)
@given(chunk=st.integers(1, 30), bias=st.booleans(), seed=st.integers(0, 10_000))
def test_any_chunk_equals_the_full_log_softmax(chunk, bias, seed):
    """Invariant: the vocabulary's chunking changes nothing but rounding; t = 0 is 0 (nothing predicts it)."""
    hidden, weight, b, ids = _case(seed=seed, bias=bias)
    got = token_surprisal(hidden, weight, ids, b, chunk=chunk)
    torch.testing.assert_close(got, _full(hidden, weight, b, ids).clamp_min(0), rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32 and bool((got[:, 0] == 0).all()) and bool((got >= 0).all())


def test_padding_and_the_first_real_token_are_zero():
    hidden, weight, b, ids = _case()
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding: token 3 is row 1's first real token
    got = token_surprisal(hidden, weight, ids, b, mask)
    full = token_surprisal(hidden, weight, ids, b)
    assert bool((got[1, :4] == 0).all())
    torch.testing.assert_close(got[1, 4:], full[1, 4:])
    torch.testing.assert_close(got[0], full[0])


def test_a_certain_token_has_no_negative_surprisal():
    """p(x_t) rounding to 1 may leave log-sum-exp a hair below the picked logit: clamped at 0, never negative."""
    hidden = torch.zeros(1, 3, 4)
    hidden[..., 0] = 60.0
    weight = torch.zeros(5, 4)
    weight[2, 0] = 1.0
    got = token_surprisal(hidden, weight, torch.tensor([[2, 2, 2]]))
    assert bool((got >= 0).all()) and float(got.max()) < 1e-6


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"hidden": torch.randn(9, 6)}, ValueError, "hidden"),
        ({"hidden": torch.ones(2, 9, 6, dtype=torch.long)}, TypeError, "hidden"),
        ({"weight": torch.randn(23, 5)}, ValueError, "weight must be"),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, ValueError, "input_ids must be"),
        ({"input_ids": torch.zeros(2, 9)}, TypeError, "input_ids must be an integer"),
        ({"input_ids": torch.full((2, 9), 23)}, ValueError, r"input_ids must lie in \[0, V=23\)"),
        ({"bias": torch.randn(22)}, ValueError, "bias must be"),
        ({"attention_mask": torch.ones(2, 8)}, ValueError, "attention_mask must be"),
        ({"chunk": 0}, ValueError, "chunk"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    hidden, weight, b, ids = _case()
    args = {"hidden": hidden, "weight": weight, "input_ids": ids, "bias": b} | kwargs
    with pytest.raises(error, match=match):
        token_surprisal(**args)
