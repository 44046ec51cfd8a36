"""``kvpages.sink_score``: the query-free token importance page codecs rank tokens by."""

import pytest
import torch

from kvpages import sink_score


def test_the_score_follows_its_tokens_and_ranks_a_sink_first():
    """Invariant: permuting a page's tokens permutes their scores (no position enters it), and a token whose key is
    far from the page's mean key with a small value outranks every other token."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(16, 2, 8, generator=g), torch.randn(16, 2, 8, generator=g)
    k[5] += 20.0
    v[5] *= 0.05
    s = sink_score(k, v)
    assert s.shape == (16,) and s.dtype == torch.float32 and int(s.argmax()) == 5
    perm = torch.randperm(16, generator=g)
    assert torch.allclose(sink_score(k[perm], v[perm]), s[perm], rtol=1e-5)


def test_bad_pages_are_refused():
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        sink_score(torch.zeros(4, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="same tokens"):
        sink_score(torch.zeros(4, 2, 8), torch.zeros(5, 2, 8))
    with pytest.raises(TypeError, match="tensors"):
        sink_score([[0.0]], torch.zeros(1, 1, 1))
