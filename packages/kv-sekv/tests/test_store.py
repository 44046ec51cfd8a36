"""SEKVStore: SEKV's decode properties (spec §3, properties 4–8); its Store suite is in test_conformance.py."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sekv_testkit import SMALL, context, router, written

from kv_sekv import SEKVConfig, routing_summaries, sekv
from kvcore import ScoringContext, reference_attention
from kvcore.memory import reachable_bytes

ZOOM = SEKVConfig(window=4, min_span=3, max_rank=8, proj_dim=8, zoom_share=0.5)

cases = st.tuples(
    st.sampled_from((0.3, 0.5, 0.8, 1.0)),  # budget
    st.integers(1, 2),  # B
    st.sampled_from((1, 2)),  # group
    st.sampled_from((0.0, 0.05, 0.9, 0.999)),  # tau
    st.integers(0, 999),
)


def _store(budget, B, group, tau, seed, T=48, config=SMALL, gate_bias=30.0):
    r = router(Hq=2 * group, Hkv=2, config=config, tau=tau, gate_bias=gate_bias, seed=seed)
    store, x, _ = written(budget, r, config, B=B, T=T, seed=seed)
    q = torch.randn(B, 2 * group, 1, 16, generator=torch.Generator().manual_seed(seed + 1)) * 3
    return store, x, q, r


@settings(max_examples=15, deadline=None)
@given(cases)
def test_two_stage_merge_equals_one_softmax(args):
    """attend(q): Stage 1 (resident + coarse with log|S|) and Stage 2 (factored spans) merged by lse equal one softmax
    over read(q) (kvcore.reference_attention)."""
    store, _, q, _ = _store(*args, T=96, config=ZOOM)
    view = store.read(q)
    want = reference_attention(view, q)
    got = store.attend(q)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("budget", "B", "group", "tau", "seed"), [(0.4, 1, 2, 0.05, 0), (1.0, 2, 1, 0.05, 3)])
def test_two_stage_on_the_triton_path_equals_one_softmax(monkeypatch, budget, B, group, tau, seed):
    """attend(q) through the kernels a GPU runs (routing gate, Stage 1 splits over the resident and the coarse
    entries, Stage 2 items, kvcodec's merge kernel; compiled on a GPU, under the Triton interpreter on a CPU) equals
    one softmax over read(q), with spans expanded."""
    pytest.importorskip("triton")
    import os

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    import kv_sekv.kernels.dispatch as dispatch

    r = router(Hq=2 * group, Hkv=2, config=ZOOM, tau=tau, gate_bias=30.0, seed=seed)
    x = context(B=B, T=96, seed=seed)
    device = "cuda" if cuda else "cpu"
    x = ScoringContext(x.keys.to(device), x.values.to(device), extras={"surprisal": x.extras["surprisal"].to(device)})
    store = sekv(budget, r, ZOOM).compress(x)
    q = (torch.randn(B, 2 * group, 1, 16, generator=torch.Generator().manual_seed(seed + 1)) * 3).to(device)
    want = reference_attention(store.read(q), q)
    launched = []  # on a GPU the kernels run compiled; on a CPU they are forced, under the interpreter
    monkeypatch.setattr(dispatch, "use_triton", lambda t: launched.append(1) or True)
    got = store.attend(q)
    assert store.last_step.expanded > 0 and len(launched) == 5  # routing, 2x Stage 1, Stage 2, merge
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 2), st.sampled_from((1, 2)), st.integers(0, 999))
def test_full_budget_zero_tau_unit_gates_is_full_attention(B, group, seed):
    """Budget 100 %, τ = 0, all gates 1, R_max >= d_h: every span is expanded exactly, so the output is full-KV
    attention over the original tokens."""
    config = SEKVConfig(window=4, min_span=3, max_rank=16, proj_dim=8)
    store, x, q, _ = _store(1.0, B, group, 0.0, seed, config=config)
    out, lse = store.attend(q)
    D = x.keys.shape[-1]
    k = x.keys.repeat_interleave(group, 1)
    v = x.values.repeat_interleave(group, 1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=1e-4, atol=1e-4)
    assert store.last_step.expanded == int(store._spans.alive.sum())


@settings(max_examples=20, deadline=None)
@given(cases)
def test_each_span_appears_once_per_head(args):
    """In read(q) every span is, per KV head, either its coarse entry (at its last position, bias log|S|) or all its
    tokens (bias 0), never both; resident tokens are all there."""
    store, _, q, _ = _store(*args)
    view = store.read(q)
    sp = store._spans
    B, H = view.positions.shape[:2]
    for b in range(B):
        for h in range(H):
            pos = view.positions[b, h]
            bias = view.logit_bias[b, h]
            held = {int(p): float(bb) for p, bb in zip(pos, bias) if p >= 0}
            for _s, tp in enumerate(sp.token_pos[b]):
                tokens = [int(p) for p in tp]
                inside = [p in held for p in tokens]
                if all(inside):
                    assert all(held[p] == 0.0 for p in tokens)
                else:
                    assert inside == [False] * (len(tokens) - 1) + [True]
                    assert held[tokens[-1]] == pytest.approx(math.log(len(tokens)))


@settings(max_examples=12, deadline=None)
@given(st.sampled_from((0.35, 0.5, 0.7)), st.integers(1, 2), st.sampled_from((1, 2)), st.integers(0, 999))
def test_cap_keeps_the_highest_gates_within_the_budget(budget, B, group, seed):
    """Spans to expand are {α̃ > τ} (Eq. 9, GQA union), taken in descending gate order while they fit what the budget
    leaves after the persistent part (one that does not fit is skipped); recomputed here from W, τ and the coarse
    keys."""
    store, _x, q, r = _store(budget, B, group, 0.05, seed, T=96, config=ZOOM)
    store.read(q)
    sp = store._spans
    W, tau = r.W[0].detach(), r.tau[0].detach()
    Hkv = 2
    summ = routing_summaries(sp.coarse_k.float(), W)
    gate = torch.sigmoid(
        (q @ W.transpose(-1, -2)) @ summ.transpose(-1, -2) / math.sqrt(W.shape[1])
        + torch.log(sp.length.clamp_min(1).float())[:, None, None, :]
    )
    z = (gate > tau[None, :, None, None]) & (sp.length > 0)[:, None, None, :]
    zk = z.reshape(B, Hkv, -1, sp.length.shape[1]).any(2)
    prio = torch.where(z, gate, -1).reshape(B, Hkv, -1, sp.length.shape[1]).amax(2)
    view = store.read(q)
    cost = r.summary_cost(Hkv, 16)
    for b in range(B):
        expanded = {
            (h, s)
            for h in range(Hkv)
            for s, tp in enumerate(sp.token_pos[b])
            if int(tp[0]) in set(view.positions[b, h].tolist())
        }
        cand = sorted(
            (
                (float(prio[b, h, s]), h * 100 + s)
                for h in range(Hkv)
                for s in range(len(sp.token_pos[b]))
                if zk[b, h, s]
            ),
            key=lambda t: (-t[0], t[1]),
        )
        room = Hkv * sp.capacity[b] - float(store._dense.seq_lengths()[b].sum()) - float(sp.alive[b].sum()) * (1 + cost)
        want, total = set(), 0
        for _, key in cand:
            h, s = divmod(key, 100)
            if total + len(sp.token_pos[b][s]) > room:
                continue
            total += len(sp.token_pos[b][s])
            want.add((h, s))
        assert expanded == want
        assert sum(len(sp.token_pos[b][s]) for _, s in expanded) <= max(room, 0)


@pytest.mark.parametrize("seed", range(6))
def test_the_cap_leaves_out_only_spans_that_no_longer_fit(seed):
    """The cap fills the budget: every selected (KV head, span) pair it leaves out is longer than the room the
    expanded ones left — one long top-gate span never blocks shorter ones (a strict prefix would)."""
    store, _, q, r = _store(0.35, 1, 2, 0.05, seed, T=96, config=ZOOM)
    sp = store._spans
    capped, _, stats, _ = store._zoom(q)
    sp.budget = 1.0
    selected, _, _, _ = store._zoom(q)
    sp.budget = 0.35
    cost = r.summary_cost(2, 16)
    room = 2 * sp.capacity[0] - float(store._dense.seq_lengths()[0].sum()) - float(sp.alive[0].sum()) * (1 + cost)
    left = room - stats.tokens
    assert left >= 0 and bool((capped <= selected).all())
    out = (selected & ~capped)[0].nonzero().tolist()
    assert out, "the cap must bind in this case"
    assert all(int(sp.length[0, s]) > left for _h, s in out)


@pytest.mark.parametrize("budget", [0.4, 1.0])
def test_a_decode_step_reads_the_accelerator_once(budget):
    """Stage 2's span choice is a host decision (it drives the CPU -> GPU fetch of the factors): attend() makes it
    from one copy of the gates (and the budget's counts), the span lengths read once per span state, not from a
    read per comparison. Counted on CPU tensors here, where every read is counted."""
    from kvcore.testing.host_reads import HostReads

    store, _, q, _ = _store(budget, 1, 2, 0.05, 0, T=96, config=ZOOM)
    store.attend(q)  # the span state's lengths reach the host once
    with HostReads(sites=True) as reads:
        store.attend(q)
    assert store.last_step.expanded > 0
    assert reads.total == 1, dict(reads.by_site)


def test_decoded_tokens_are_counted_on_the_host_between_edits():
    """The budget cap's count of decoded tokens per row is read once with the gates, then advanced by appends (no
    device work per step); a crop, re-tier or reorder forgets it and the next step counts again -- always what the
    held positions say."""
    store, _, q, _ = _store(0.4, 2, 1, 0.05, 0, T=96, config=ZOOM)

    def counted():
        pos, last = store._dense.read().positions, torch.tensor(store._spans.prefill_last)
        return (pos > last[:, None, None]).sum(-1).amax(-1).tolist()

    store.attend(q)
    assert store._spans.decoded == counted() == [0, 0]
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        kv = torch.randn(2, 2, 2, 16, generator=g)
        store.append(kv, kv, torch.tensor([[200 + 2 * step, 201 + 2 * step]] * 2))
        assert store._spans.decoded == counted() == [2 * step + 2] * 2
        store.attend(q)
    store.crop(203)  # drops the decoded tokens at 203..205
    assert store._spans.decoded is None
    store.attend(q)
    assert store._spans.decoded == counted() == [3, 3]
    store.retier(store.tiers())  # keeps everything, but a re-tier may evict: counted again
    assert store._spans.decoded is None
    store.attend(q)
    assert store._spans.decoded == counted()


def test_the_cap_binds_and_expands_in_a_known_case():
    """A case where the gate selects more spans than the budget takes: some, not all, are reconstructed."""
    store, _, q, _ = _store(0.4, 1, 2, 0.05, 0, T=96, config=ZOOM)
    store.attend(q)
    step = store.last_step
    assert 0 < step.expanded < step.selected and step.fetched_bytes > 0


def test_bytes_follow_eqs_18_and_16():
    """CPU bytes = Σ_S 2·Hkv·r(|S| + d_h + 1)·b (raw spans: 2·Hkv·|S|·d_h·b); nbytes() is what is reachable."""
    config = SEKVConfig(window=4, min_span=3, max_rank=2, proj_dim=8)
    store, x, _, _ = _store(1.0, 1, 2, 0.05, 3, T=64, config=config)
    sp = store._spans
    D, H, b = 16, 2, 4
    want = 0
    for L in sp.length[0].tolist():
        if L == 0:
            continue
        r = min(L, D, 2)
        per = r * (L + D + 1) if r * (L + D + 1) < L * D else L * D
        want += 2 * H * per * b
    assert store.nbytes("cpu") == want + store._dense.nbytes("cpu") + _span_device_bytes(store)
    assert store.nbytes() == reachable_bytes(store)
    full = 2 * H * x.keys.shape[2] * D * b  # Eq. 16 for one layer
    assert store.nbytes() < full * 2


def _span_device_bytes(store):
    from kvcore.memory import storage_bytes

    sp = store._spans
    return storage_bytes(
        [
            sp.length,
            sp.last_pos,
            sp.alive,
            sp.coarse_k,
            sp.coarse_v,
            sp.summary,
            *[t for row in sp.token_pos for t in row],
        ]
    )


def test_decoded_tokens_are_full_precision_and_crop_reorder_work():
    store, _x, q, _ = _store(1.0, 2, 2, 0.05, 5)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
    before = store.seq_lengths().clone()
    store.append(k, v, torch.full((2, 1), 100))
    view = store.read()
    assert torch.equal(store.seq_lengths(), before + 1)
    assert torch.equal(view.keys[:, :, -1:], k) and torch.equal(view.values[:, :, -1:], v)
    assert view.positions[:, :, -1].eq(100).all()
    with pytest.raises(ValueError, match="positions"):
        store.append(k, v, torch.full((2, 1), 3))
    store.crop(100)
    assert torch.equal(store.seq_lengths(), before)
    one = store.attend(q)
    store.reorder(torch.tensor([1, 0]))
    two = store.attend(q.flip(0))
    torch.testing.assert_close(two[0], one[0].flip(0))
    store.crop(10)  # spans whose last token is cropped are dropped whole
    assert bool((store._spans is None) or (store._spans.last_pos < 10).all())
    assert store.nbytes() == reachable_bytes(store)


def test_write_is_atomic_and_refuses_nan_in_spans():
    store, x, _, _ = _store(1.0, 1, 1, 0.05, 2)
    before = (store.read().keys.clone(), store.nbytes())
    c = sekv(1.0, router(Hq=2, Hkv=2), SMALL)
    plan = c.plan(x)
    bad = x.keys.clone()
    bad[0, 0, int((plan.span_id[0] >= 0).nonzero()[0])] = float("nan")
    with pytest.raises(ValueError, match="keys"):
        store.write(bad, x.values, plan, x.positions)
    assert torch.equal(store.read().keys, before[0]) and store.nbytes() == before[1]


def test_router_of_another_model_is_refused():
    c = sekv(1.0, router(Hq=4, Hkv=2, D=8), SMALL)
    with pytest.raises(ValueError, match="train a router"):
        c.compress(context(D=16))
    c = sekv(1.0, router(L=1), SMALL)
    with pytest.raises(ValueError, match="layer 3"):
        c.compress(context(layer=3))


def test_missing_surprisal_is_named():
    c = sekv(1.0, router(), SMALL)
    x = context()
    with pytest.raises(ValueError, match="surprisal"):
        c.compress(ScoringContext(x.keys, x.values))


def test_budget_outside_range_and_report():
    with pytest.raises(ValueError, match="budget"):
        sekv(0.0, router())
    with pytest.raises(ValueError, match="budget"):
        sekv(1.5, router())
    store, _, _ = written(0.5)
    assert 0 < store.used[0] <= 0.5 and store.alpha[0] >= 1.0


def test_threaded_fetch_gives_the_same_result_and_counts_eq_20_bytes():
    """fetch='thread' (factors fetched while Stage 1 runs) equals the synchronous path; the bytes fetched are those
    of the expanded spans' per-head factors (Eq. 20)."""
    r = router(Hq=4, Hkv=2, config=ZOOM, tau=0.05, seed=0)
    x = context(T=96, seed=0)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1)) * 3
    sync = sekv(0.4, r, ZOOM).compress(x)
    threaded = sekv(0.4, r, ZOOM, fetch="thread").compress(x)
    a, b = sync.attend(q), threaded.attend(q)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert sync.last_step == threaded.last_step and sync.last_step.expanded > 0
    sync.read(q)
    assert sync.last_step.fetched_bytes == threaded.last_step.fetched_bytes
    with pytest.raises(ValueError, match="fetch"):
        sekv(0.4, r, ZOOM, fetch="async")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_stream_fetch_gives_the_same_result(device):
    """fetch='stream': on CUDA the factors are copied on a copy stream beside Stage 1 and Stage 2 waits for them by
    an event; the result and the bytes equal the synchronous path's (off CUDA it is the synchronous path)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the copy stream exists on CUDA only (the CPU case runs everywhere)")
    r = router(Hq=4, Hkv=2, config=ZOOM, tau=0.05, seed=0)
    x = context(T=96, seed=0)
    x = ScoringContext(x.keys.to(device), x.values.to(device), extras={"surprisal": x.extras["surprisal"].to(device)})
    q = (torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1)) * 3).to(device)
    sync = sekv(0.4, r, ZOOM).compress(x)
    streamed = sekv(0.4, r, ZOOM, fetch="stream").compress(x)
    for _ in range(3):  # the copy stream and its event across steps
        a, b = sync.attend(q), streamed.attend(q)
        torch.testing.assert_close(b[0], a[0], rtol=0, atol=0)
        torch.testing.assert_close(b[1], a[1], rtol=0, atol=0)
    assert sync.last_step == streamed.last_step and sync.last_step.expanded > 0
