"""Surprisal (Eq. 1): the chunked-vocabulary computation equals the full log-softmax reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sekv import surprisal_from_hidden, surprisal_from_logits


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 12), st.integers(2, 40), st.integers(1, 50), st.booleans(), st.integers(0, 99))
def test_chunked_equals_full_log_softmax(B, T, V, chunk, with_bias, seed):
    """For every chunk size (1 .. > V), H_t = −log softmax(h_{t−1} Wᵀ + b)[x_t]; position 0 is 0."""
    g = torch.Generator().manual_seed(seed)
    hidden, W = torch.randn(B, T, 8, generator=g), torch.randn(V, 8, generator=g)
    bias = torch.randn(V, generator=g) if with_bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    logits = hidden @ W.T + (0 if bias is None else bias)
    got = surprisal_from_hidden(hidden, W, ids, bias, chunk=chunk)
    torch.testing.assert_close(got, surprisal_from_logits(logits, ids), rtol=1e-5, atol=1e-5)
    assert bool((got[:, 0] == 0).all()) and bool((got >= -1e-5).all())


def test_padding_and_first_real_token_are_zero():
    g = torch.Generator().manual_seed(0)
    hidden, W = torch.randn(2, 6, 4, generator=g), torch.randn(9, 4, generator=g)
    ids = torch.randint(0, 9, (2, 6), generator=g)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    s = surprisal_from_hidden(hidden, W, ids, attention_mask=mask)
    full = surprisal_from_hidden(hidden, W, ids)
    assert s[1, :3].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(s[1, 3:], full[1, 3:]) and torch.equal(s[0], full[0])


def test_bad_input():
    h, W, ids = torch.randn(1, 4, 3), torch.randn(5, 3), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="weight"):
        surprisal_from_hidden(h, torch.randn(5, 2), ids)
    with pytest.raises(ValueError, match="input_ids"):
        surprisal_from_hidden(h, W, ids + 5)
    with pytest.raises(TypeError, match="input_ids"):
        surprisal_from_hidden(h, W, ids.float())
    with pytest.raises(ValueError, match="chunk"):
        surprisal_from_hidden(h, W, ids, chunk=0)


def test_logits_reference_refuses_bad_ids_by_name():
    logits, ids = torch.randn(1, 4, 5), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        surprisal_from_logits(logits, ids.float() + 0.7)  # never truncated to a valid-looking index
    with pytest.raises(ValueError, match=r"input_ids must be \[B=1, T=4\]"):
        surprisal_from_logits(logits, ids[:, :3])
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, V=5\)"):
        surprisal_from_logits(logits, ids + 5)
