"""``kvcore.attention``: reference attention against a naive per-head loop (GQA, logit bias, ``-inf`` padding, the
log-sum-exp), and ``merge_attention``: attention over a split key set, merged, equals attention over the whole set
(the online-softmax identity, FlashAttention, Dao et al. 2022, §3.1)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import KVView, merge_attention, merge_split_attention, reference_attention

FAST = settings(max_examples=25, deadline=None)


@st.composite
def views(draw):
    """``(view, query, scale)``: ragged heads (``-inf`` bias and position -1 on padding), some heads empty, a
    finite bias on some entries (SEKV-like span summaries), GQA group 1/2/4."""
    B, H, T = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, 9))
    D = draw(st.sampled_from((4, 8)))
    group, Q, seed = draw(st.sampled_from((1, 2, 4))), draw(st.integers(1, 3)), draw(st.integers(0, 10**6))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16)))
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
    lens = torch.randint(0, T + 1, (B, H), generator=g)
    valid = torch.arange(T) < lens[..., None]
    bias = torch.where(torch.rand(B, H, T, generator=g) < 0.3, torch.rand(B, H, T, generator=g) * 2, 0.0)
    bias = bias.masked_fill(~valid, float("-inf"))
    positions = torch.where(valid, torch.arange(T), -1)
    keys, values = keys.masked_fill(~valid[..., None], 0), values.masked_fill(~valid[..., None], 0)
    query = torch.randn(B, H * group, Q, D, generator=g).to(draw(st.sampled_from((dtype, torch.float32))))
    scale = draw(st.none() | st.floats(0.1, 2.0))
    return KVView(keys, values, positions, bias), query, scale


def naive(view: KVView, query: torch.Tensor, scale: float | None):
    """One query row at a time in float64: ``softmax(q·k·scale + bias)·v`` over the head's entries."""
    B, H, T, D = view.keys.shape
    Hq, Q = query.shape[1], query.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out, lse = torch.zeros(B, Hq, Q, D, dtype=torch.float64), torch.full((B, Hq, Q), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for j in range(Hq):
            h = j // (Hq // H)
            k, v, bias = view.keys[b, h].double(), view.values[b, h].double(), view.logit_bias[b, h].double()
            for i in range(Q):
                logits = [float(query[b, j, i].double() @ k[t]) * scale + float(bias[t]) for t in range(T)]
                finite = [x for x in logits if x != float("-inf")]
                if not finite:
                    continue
                m = max(finite)
                w = torch.tensor([math.exp(x - m) if x != float("-inf") else 0.0 for x in logits], dtype=torch.float64)
                lse[b, j, i] = m + math.log(float(w.sum()))
                out[b, j, i] = (w / w.sum()) @ v
    return out, lse


@FAST
@given(case=views())
def test_reference_attention_matches_a_naive_loop(case):
    view, query, scale = case
    out, lse = reference_attention(view, query, scale)
    want_out, want_lse = naive(view, query, scale)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == query.shape[:3] + (view.keys.shape[-1],) and lse.shape == query.shape[:3]
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    empty = torch.isneginf(want_lse)
    assert bool((out[empty] == 0).all()), "a row that sees no entry must give out = 0"
    torch.testing.assert_close(view.attend(query, scale), out)


@FAST
@given(case=views(), parts=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_merge_of_a_split_key_set_equals_attention_over_the_whole(case, parts, seed):
    view, query, scale = case
    whole = reference_attention(view, query, scale)
    part_of = torch.randint(parts, view.positions.shape, generator=torch.Generator().manual_seed(seed))
    pieces = []
    for p in range(parts):  # disjoint subsets of the entries: the others get -inf bias (some subsets are empty)
        bias = view.logit_bias.masked_fill(part_of != p, float("-inf"))
        pieces.append(reference_attention(KVView(view.keys, view.values, view.positions, bias), query, scale))
    out, lse = merge_attention(pieces)
    torch.testing.assert_close(lse, whole[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, whole[0], rtol=1e-5, atol=1e-5)


def test_merge_of_parts_that_see_nothing():
    out_a, lse_a = torch.randn(2, 3, 4), torch.full((2, 3), float("-inf"))
    out, lse = merge_attention([(torch.zeros(2, 3, 4), lse_a), (torch.zeros(2, 3, 4), lse_a.clone())])
    assert bool(torch.isneginf(lse).all()) and bool((out == 0).all()) and not bool(out.isnan().any())
    lse_b = torch.tensor([[0.5, float("-inf"), 1.0], [2.0, 0.0, float("-inf")]])
    out, lse = merge_attention([(torch.zeros(2, 3, 4), lse_a), (out_a, lse_b)])  # the empty part adds nothing
    torch.testing.assert_close(lse, lse_b)
    torch.testing.assert_close(out, torch.where(torch.isneginf(lse_b)[..., None], 0.0, out_a))


@pytest.mark.parametrize("dim", [0, 1, -3])
def test_merge_of_stacked_splits_equals_the_merge_of_the_list(dim):
    """merge_split_attention over splits stacked along any dim = merge_attention of the splits as a list,
    including a split that saw nothing and a row that no split saw (out 0, lse -inf)."""
    g = torch.Generator().manual_seed(3)
    outs, lses = torch.randn(4, 2, 3, 5, generator=g), torch.randn(4, 2, 3, generator=g)
    lses[1] = float("-inf")  # a split that sees nothing
    lses[:, 0, 2] = float("-inf")  # a row no split sees
    outs[:, 0, 2] = 0.0  # what a kernel writes there
    want = merge_attention(list(zip(outs.unbind(0), lses.unbind(0))))
    d = dim % 3  # dim indexes lse's dims; out has the trailing D
    got = merge_split_attention(outs.movedim(0, d), lses.movedim(0, d), dim)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1])
    assert bool(torch.isneginf(got[1][0, 2])) and bool((got[0][0, 2] == 0).all())


def test_merge_needs_a_part():
    with pytest.raises(ValueError, match="at least one"):
        merge_attention([])


@pytest.mark.parametrize(
    "query, scale",
    [
        (torch.randn(1, 4, 2, 6), None),  # another head dim
        (torch.randn(1, 3, 2, 8), None),  # Hq not a multiple of Hkv = 2
        (torch.randn(2, 4, 2, 8), None),  # another batch
        (torch.randn(4, 2, 8), None),  # rank 3
        (torch.ones(1, 4, 2, 8, dtype=torch.int32), None),
        (torch.randn(1, 4, 2, 8), 0.0),
        (torch.randn(1, 4, 2, 8), float("nan")),
        (torch.randn(1, 4, 2, 8), True),
    ],
    ids=["head-dim", "hq", "batch", "rank", "int", "scale-0", "scale-nan", "scale-bool"],
)
def test_reference_attention_rejects(query, scale):
    x = torch.randn(1, 2, 5, 8)
    view = KVView(x, x, torch.arange(5).expand(1, 2, 5), torch.zeros(1, 2, 5))
    with pytest.raises((ValueError, TypeError), match="query|scale"):
        reference_attention(view, query, scale)
