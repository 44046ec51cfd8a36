"""SentenceKV: punctuation sentences, the prefill plan carrying them, and the store's per-step retrieval against a
loop-based reference written from the authors' decoding step."""

from __future__ import annotations

import pytest
import torch

import kv_baselines as kb
from kv_baselines.sentence import (
    SENTENCE_EXTRA,
    SentencePlan,
    SentenceScores,
    is_sentence_end,
    sentence_ids,
)
from kvcore import Budget, Plan, ScoringContext, registry


def test_sentence_ends_and_ids():
    assert is_sentence_end(".") and is_sentence_end("end. ") and is_sentence_end("?!") and is_sentence_end("a\nb")
    assert not is_sentence_end(" the") and not is_sentence_end("") and not is_sentence_end("3.5x")
    ids = torch.tensor([[5, 1, 2, 5, 5, 3], [1, 1, 1, 1, 1, 1]])
    got = sentence_ids(ids, lambda i: i == 5)
    want = []
    for row in ids.tolist():
        n, out = 0, []
        for t in row:
            out.append(n)
            n += t == 5
        want.append(out)
    assert got.tolist() == want
    with pytest.raises(TypeError, match="input_ids"):
        sentence_ids(torch.ones(1, 3), lambda i: False)
    with pytest.raises(TypeError, match="is_end"):
        sentence_ids(ids, None)


def _compressed(B=2, H=2, G=2, T=120, D=8, ratio=0.3, seed=0, **store):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, H * G, 8, D, generator=g)
    sid = torch.stack([torch.arange(T) // 7, torch.arange(T) // 11])[:B]
    comp = kb.sentencekv(ratio, window=8, kernel_size=3, **store)
    ctx = ScoringContext(k, v, q, extras={SENTENCE_EXTRA: sid})
    return comp, ctx, comp.compress(ctx), sid


def _naive_attended(store, query, table_sid, prompt_end):
    """Loop transcription of the authors' decoding step over what the store holds (module docstring)."""
    view = kb.SentenceKVStore.read(store)  # the whole cache
    B, H, T, _ = view.keys.shape
    G = query.shape[1] // H
    out = torch.zeros(B, H, T, dtype=torch.bool)
    for b in range(B):
        decoded_id = int(table_sid[b].max()) + 1
        for h in range(H):
            entries = [t for t in range(T) if int(view.positions[b, h, t]) >= 0]
            n = len(entries)
            sent = {}
            for t in entries:
                p = int(view.positions[b, h, t])
                sent[t] = int(table_sid[b, p]) if p < prompt_end else decoded_id
            groups = {}
            for t in entries:
                groups.setdefault(sent[t], []).append(t)
            q = sum(query[b, h * G + i].float().mean(0) for i in range(G)) / G
            sims = {
                s: float(torch.stack([view.keys[b, h, t].float() for t in ts]).mean(0) @ q) for s, ts in groups.items()
            }
            order = sorted(groups, key=lambda s: (-sims[s], s))
            fixed = {t for i, t in enumerate(entries) if i < store.sinks or i >= n - store.recent}
            limit = max(0, int(store._limit[b, h]))
            chosen = []
            for s in order:
                for t in groups[s]:
                    if t not in fixed and len(chosen) < limit:
                        chosen.append(t)
            for t in fixed | set(chosen):
                out[b, h, t] = True
    return out


@pytest.mark.parametrize(("sinks", "recent", "factor"), [(4, 4, 2.0), (0, 8, 1.5), (32, 32, 5.0), (2, 0, 1.0)])
def test_retrieval_matches_naive_reference(sinks, recent, factor):
    _, _, store, sid = _compressed(sinks=sinks, recent=recent, semantic_factor=factor)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        query = torch.randn(2, 4, 1, 8, generator=g)
        got = store.read(query).logit_bias == 0
        assert torch.equal(got, _naive_attended(store, query, sid, 120)), step
        store.append(
            torch.randn(2, 2, 2, 8, generator=g),
            torch.randn(2, 2, 2, 8, generator=g),
            torch.tensor([[120 + 2 * step, 121 + 2 * step]] * 2),
        )


def test_read_without_query_is_the_whole_cache_and_counts_follow_the_budget():
    comp, ctx, store, _ = _compressed(ratio=0.5)
    assert store.seq_lengths().eq(60).all()
    view = store.read()
    assert bool(torch.isfinite(view.logit_bias[view.valid]).all())
    assert torch.equal(store._limit, torch.full((2, 2), 60 // 5 - 64).clamp(min=0))
    plan = comp.plan(ctx)
    assert isinstance(plan, SentencePlan) and torch.equal(plan.sentence_id, ctx.extras[SENTENCE_EXTRA])


def test_plain_plan_puts_the_prompt_in_one_sentence_and_reorder_crop_follow():
    store = kb.SentenceKVStore(sinks=1, recent=1, semantic_factor=1.0)
    k = torch.randn(2, 1, 10, 4)
    store.write(k, k, Plan.from_keep(torch.ones(2, 1, 10, dtype=torch.bool)), torch.arange(10).expand(2, 10))
    assert store.sentences().unique().tolist() == [0]
    store.reorder(torch.tensor([1, 1]))
    store.crop(6)
    store.append(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4), torch.tensor([[6], [6]]))
    assert store.sentences()[0, 0].tolist() == [0] * 6 + [1]
    assert store.sentences().shape == store.read().positions.shape


def test_registered_defaults_and_bad_input():
    c = registry.discover()["sentencekv"].build(Budget(ratio=0.75))
    assert c.name == "sentencekv" and c.budget.ratio == 0.75
    base = c.scorer.base
    assert (base.window, base.kernel_size, base.pooling) == (32, 7, "max")
    store = c.new_store()
    assert (store.sinks, store.recent, store.semantic_factor, store.query_dependent) == (32, 32, 5.0, True)
    assert SENTENCE_EXTRA in c.scorer.needs_extras and c.scorer.needs_queries
    for kw, err, name in (
        ({"sinks": -1}, ValueError, "sinks"),
        ({"recent": 1.5}, TypeError, "recent"),
        ({"semantic_factor": 0.5}, ValueError, "semantic_factor"),
    ):
        with pytest.raises(err, match=name):
            kb.SentenceKVStore(**kw)
        with pytest.raises(err, match=name):
            kb.sentencekv(0.5, **kw)
    k = torch.randn(1, 1, 8, 4)
    scorer = kb.SentenceKVScorer(kb.SnapKVScorer(window=2))
    for bad in (torch.zeros(1, 7, dtype=torch.long), torch.zeros(1, 8), -torch.ones(1, 8, dtype=torch.long), [0] * 8):
        with pytest.raises(ValueError, match=SENTENCE_EXTRA):
            scorer.score(ScoringContext(k, k, torch.randn(1, 1, 2, 4), extras={SENTENCE_EXTRA: bad}))
    with pytest.raises(ValueError, match=SENTENCE_EXTRA):
        scorer.score(ScoringContext(k, k, torch.randn(1, 1, 2, 4)))
    with pytest.raises(ValueError, match="sentence_id"):
        SentenceScores(torch.zeros(1, 1, 8), sentence_id=torch.zeros(1, 8))
    with pytest.raises(TypeError, match="base"):
        kb.SentenceSelector(base="topk")
    _, _, store, _ = _compressed()
    with pytest.raises(ValueError, match="query"):
        store.read(torch.randn(2, 4, 8))
