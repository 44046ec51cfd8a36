"""The joint importance scorer: the window-sum property (spec 11), the joint metric (its conformance suite is in
test_conformance.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kv_hqekv import HqeKVScorer, window_importance_ref
from kvcore import ScoringContext


@given(st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 2]), st.integers(20, 40), st.integers(0, 999))
def test_window_mass(B, Hkv, g, N, seed):
    """Each window query's softmax sums to 1, so Σ_j A_j·c_j = m·B·Hq at prefill (s >= m)."""
    gen = torch.Generator().manual_seed(seed)
    m = 20
    q = torch.randn(B, Hkv * g, m, 8, generator=gen)
    k = torch.randn(B, Hkv, N, 8, generator=gen)
    a = window_importance_ref(q, k)
    c = (N - torch.arange(N)).clamp(max=m).float()
    assert float((a * c).sum()) == pytest.approx(m * B * Hkv * g, rel=1e-5)
    plain = window_importance_ref(q, k, normalize=False)
    assert torch.allclose(plain, a * c, rtol=1e-5, atol=1e-6)


def test_causal_and_joint_metric():
    """Window query i sees keys up to column N - m + i only; value score = A·Range; scores are shared by heads."""
    gen = torch.Generator().manual_seed(0)
    B, H, N, D, m = 2, 2, 12, 8, 4
    k, v, q = torch.randn(B, H, N, D, generator=gen), torch.randn(B, H, N, D, generator=gen), torch.randn(B, 4, m, D)
    s = HqeKVScorer(window=m).score(ScoringContext(keys=k, values=v, queries=q))
    a = window_importance_ref(q, k).sum(0)
    assert torch.allclose(s.keys[0, 0], a) and torch.equal(s.keys[0, 0], s.keys[1, 1])
    rng = (v.amax(-1) - v.amin(-1)).sum(dim=(0, 1))
    assert torch.allclose(s.values[0, 0], a * rng)
    # causal: a key after every window query's column is seen by none of them... the last key is seen by the
    # last query only, so changing it leaves the attention of the other window queries (plain sum) unchanged
    k2 = k.clone()
    k2[..., -1, :] += 5
    q1 = q[:, :, :-1]
    assert torch.allclose(
        window_importance_ref(q1, k[..., :-1, :], normalize=False),
        window_importance_ref(q1, k2[..., :-1, :], normalize=False),
    )
    a_full, a_last = window_importance_ref(q, k, normalize=False), window_importance_ref(q, k2, normalize=False)
    assert not torch.allclose(a_full[:, -1], a_last[:, -1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        HqeKVScorer(window=0)
    with pytest.raises(TypeError, match="times_range"):
        HqeKVScorer(times_range="yes")
    ctx = ScoringContext(keys=torch.randn(1, 1, 8, 4), values=torch.randn(1, 1, 8, 4))
    with pytest.raises(ValueError, match="queries"):
        HqeKVScorer().score(ctx)
