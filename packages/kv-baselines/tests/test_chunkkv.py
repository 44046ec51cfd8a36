"""ChunkKV: kept entries are whole chunks, the same in every head, ranked by the head-summed base score."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_baselines as kb
from kvcore import Budget, ScoringContext, registry


def _ctx(B, H, T, D=8, W=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, T, D, generator=g)
    return ScoringContext(
        keys=keys, values=torch.randn(B, H, T, D, generator=g), queries=torch.randn(B, 2 * H, W, D, generator=g)
    )


# a short T at ratio 0.75 keeps fewer entries than the window protects: the compressor then keeps the window and
# warns (that warning has its own test in test_scorers.py); the invariant below holds either way
@pytest.mark.filterwarnings("ignore::kvcore.ShortInputWarning")
@settings(max_examples=25, deadline=None)
@given(T=st.integers(12, 60), chunk=st.integers(1, 9), ratio=st.sampled_from([0.3, 0.5, 0.75]), seed=st.integers(0, 99))
def test_kept_tokens_are_whole_chunks_shared_by_every_head(T, chunk, ratio, seed):
    """Invariant: outside the protected window, every chunk is kept whole or not at all — except at most one chunk
    per head, where the budget ends — and every head keeps the same positions."""
    W = 4
    comp = kb.chunkkv(ratio, chunk=chunk, window=W)
    ctx = _ctx(1, 2, T, W=W, seed=seed)
    plan = comp.plan(ctx)
    kept = plan.key_bits != 0  # [B, H, T]
    assert torch.equal(kept[:, 0], kept[:, 1])
    content = kept[0, 0, : T - W]
    partial = 0
    for start in range(0, T - W, chunk):
        piece = content[start : start + chunk]
        if (T - W) - start < chunk:  # a chunk cut by the window: its content part behaves like a partial chunk
            continue
        partial += bool(piece.any() and not piece.all())
    assert partial <= 1
    assert bool(kept[0, 0, T - W :].all())  # the observation window is always kept


def test_chunk_scores_are_head_summed_chunk_means_without_protected_tokens():
    base = kb.SnapKVScorer(window=4)
    ctx = _ctx(2, 3, 23)
    protected = torch.zeros(2, 23, dtype=torch.bool)
    protected[:, -4:] = True
    ctx = ScoringContext(keys=ctx.keys, values=ctx.values, queries=ctx.queries, protected=protected)
    got = kb.ChunkKVScorer(base, chunk=5).score(ctx).keys
    s = base.score(ctx).keys.sum(1)  # [B, T]
    for b in range(2):
        for start in range(0, 23, 5):
            idx = [t for t in range(start, min(start + 5, 23)) if t < 19]
            want = s[b, idx].mean() if idx else torch.tensor(0.0)
            for t in range(start, min(start + 5, 23)):
                assert got[b, :, t] == pytest.approx(float(want), rel=1e-5)


def test_chunk_one_ranks_like_the_head_summed_base():
    base = kb.SnapKVScorer(window=4)
    ctx = _ctx(1, 2, 30)
    got = kb.ChunkKVScorer(base, chunk=1).score(ctx).keys[0, 0]
    assert torch.allclose(got, base.score(ctx).keys[0].sum(0))


def test_registered_and_bad_input():
    c = registry.discover()["chunkkv"].build(Budget(ratio=0.8))
    assert c.name == "chunkkv" and c.budget.ratio == 0.8 and isinstance(c.scorer, kb.ChunkKVScorer)
    assert c.scorer.chunk == 10 and c.scorer.needs_queries and c.scorer.query_window == 64
    with pytest.raises(ValueError, match="chunk"):
        kb.ChunkKVScorer(chunk=0)
    with pytest.raises(TypeError, match="base must implement kvcore.Scorer"):
        kb.ChunkKVScorer(base="snapkv")
