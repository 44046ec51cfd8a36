"""KIVIStore: the plan is the truth, KIVI's residual policies, real eviction, crop/reorder/reset."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import EVICT, FULL, DenseStore, KVView, Plan, Store

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

from kv_baselines.quant import KIVIStore, UniformQuantizer, kivi_tiers


def _store(bits=2, vbits=None, G=4, R=8):
    return KIVIStore(UniformQuantizer(bits, "channel", G), UniformQuantizer(vbits or bits, "token", G), residual=R)


def _roundtrip(q, x):
    return q.dequantize(q.quantize(x))


def _expected_head(store, x, tiers, kind):
    """Expected read of one head's kept entries: FULL exact, quantized through the quantizer in the store's
    groups (consecutive quantized entries, G at a time for per-channel keys, one token for values)."""
    q = store.key_quantizer if kind == "k" else store.value_quantizer
    kept = tiers != EVICT
    out = x[kept].clone()
    qidx = (tiers[kept] == q.bits).nonzero().flatten()
    unit = q.group_size if q.axis == "channel" else 1
    for start in range(0, qidx.numel(), unit):
        idx = qidx[start : start + unit]
        out[idx] = _roundtrip(q, x[kept][idx][None])[0]
    return out


plans = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPES),
        "B": st.integers(1, 2),
        "H": st.integers(1, 3),
        "T": st.integers(1, 30),
        "D": st.sampled_from([4, 9]),
        "bits": st.sampled_from([2, 4]),
        "vbits": st.sampled_from([2, 3]),
        "keep_p": st.sampled_from([0.3, 0.7, 1.0]),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def _random_write(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, H, T, D = c["B"], c["H"], c["T"], c["D"]
    keys = (torch.randn(B, H, T, D, generator=g) * 3).to(c["dtype"])
    values = torch.randn(B, H, T, D, generator=g).to(c["dtype"])
    keep = torch.rand(B, H, T, generator=g) < c["keep_p"]
    kb = torch.where(torch.rand(B, H, T, generator=g) < 0.6, c["bits"], FULL)
    vb = torch.where(torch.rand(B, H, T, generator=g) < 0.6, c["vbits"], FULL)
    plan = Plan(torch.where(keep, kb, EVICT).to(torch.uint8), torch.where(keep, vb, EVICT).to(torch.uint8))
    positions = torch.arange(T).expand(B, T) * 3 + 5  # true positions, not cache indices
    store = _store(c["bits"], c["vbits"], G=4, R=8)
    store.write(keys, values, plan, positions)
    return store, keys, values, plan, positions


@settings(max_examples=15, deadline=None)
@given(plans)
def test_write_follows_the_plan(c):
    store, keys, values, plan, positions = _random_write(c)
    view = store.read()
    assert isinstance(view, KVView)
    B, H, _T = plan.key_bits.shape
    keep = plan.keep_keys
    n = keep.sum(-1)
    assert torch.equal(store.seq_lengths(), n)
    assert view.keys.dtype == keys.dtype and view.keys.shape[2] == int(n.max())
    for b in range(B):
        for h in range(H):
            k = int(n[b, h])
            assert torch.equal(view.positions[b, h, :k], positions[b][keep[b, h]])
            assert bool((view.positions[b, h, k:] == -1).all())
            assert bool((view.logit_bias[b, h, :k] == 0).all())
            assert bool(torch.isneginf(view.logit_bias[b, h, k:]).all())
            exp_k = _expected_head(store, keys[b, h], plan.key_bits[b, h], "k")
            exp_v = _expected_head(store, values[b, h], plan.bits_for_values[b, h], "v")
            assert torch.equal(view.keys[b, h, :k], exp_k)
            assert torch.equal(view.values[b, h, :k], exp_v)
            # FULL entries are bit-exact
            full_k = plan.key_bits[b, h][keep[b, h]] == FULL
            assert torch.equal(view.keys[b, h, :k][full_k], keys[b, h][keep[b, h]][full_k])
    counts = store.entry_counts()
    assert torch.equal(counts["keys_quantized"], (plan.key_bits == c["bits"]).sum(-1))
    assert torch.equal(counts["keys_full"], (plan.key_bits == FULL).sum(-1))
    assert torch.equal(counts["values_quantized"], (plan.bits_for_values == c["vbits"]).sum(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_entries_within_half_scale_of_their_group(dtype):
    torch.manual_seed(0)
    G, R, bits = 4, 8, 2
    keys = (torch.randn(1, 2, 37, 16) * 4).to(dtype)
    values = torch.randn(1, 2, 37, 16).to(dtype)
    keep = torch.ones(1, 2, 37, dtype=torch.bool)
    store = _store(bits, G=G, R=R)
    plan = Plan(kivi_tiers(keep, bits, R, "keys"), kivi_tiers(keep, bits, R, "values"))
    store.write(keys, values, plan, torch.arange(37)[None])
    view = store.read()
    levels = 2**bits - 1
    eps = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    n_q = 37 - 37 % R
    for h in range(2):
        for g0 in range(0, n_q, G):  # key groups: G tokens of one channel
            x = keys[0, h, g0 : g0 + G].double()
            span = x.max(0).values - x.min(0).values
            half = 0.5 * span / levels * (1 + 2 * eps) + 2.0 ** (bits - 24)
            err = (view.keys[0, h, g0 : g0 + G].double() - x).abs()
            assert bool((err <= half + eps * x.abs()).all())
        for t in range(37 - R):  # value groups: G channels of one token
            x = values[0, h, t].double().view(-1, G)
            span = x.max(1).values - x.min(1).values
            half = (0.5 * span / levels * (1 + 2 * eps) + 2.0 ** (bits - 24))[:, None]
            err = (view.values[0, h, t].double().view(-1, G) - x).abs()
            assert bool((err <= half + eps * x.abs()).all())


def test_evicted_entries_hold_no_memory():
    torch.manual_seed(1)
    B, H, T, D = 2, 3, 32, 8
    keys, values = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    # every head keeps a different half
    keep = torch.zeros(B, H, T, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            keep[b, h, torch.randperm(T)[: T // 2]] = True
    kb, vb = kivi_tiers(keep, 2, 8, "keys"), kivi_tiers(keep, 2, 8, "values")
    evicting = _store()
    evicting.write(keys, values, Plan(kb, vb), torch.arange(T).expand(B, T))

    # the same kept entries written densely, with the same tiers
    def gather(x):
        return x[keep].view(B, H, T // 2, -1)

    dense = _store()
    dense.write(
        gather(keys),
        gather(values),
        Plan(gather(kb[..., None])[..., 0], gather(vb[..., None])[..., 0]),
        torch.arange(T // 2).expand(B, T // 2),
    )
    assert evicting.nbytes() == dense.nbytes()
    everything = _store()
    ones = torch.ones_like(keep)
    everything.write(
        keys,
        values,
        Plan(kivi_tiers(ones, 2, 8, "keys"), kivi_tiers(ones, 2, 8, "values")),
        torch.arange(T).expand(B, T),
    )
    assert evicting.nbytes() < everything.nbytes()


def _packed_bytes(store, D, elem):
    """Theoretical packed size of what ``store`` holds, from its entry counts and shapes: codes, scales and zeros of
    the quantized entries (a ``[D]`` row per per-channel key group of ``G``, a ``[D/G]`` row per value token) and the
    full-precision rows (residual included), ``elem`` bytes per cache element (scales share the cache dtype here)."""
    c = store.entry_counts()
    kq, vq = store.key_quantizer, store.value_quantizer
    k_codes = int(c["keys_quantized"].sum()) * math.ceil(D * kq.bits / 8)
    k_groups = int(sum(math.ceil(int(n) / kq.group_size) for n in c["keys_quantized"].flatten()))
    v_codes = int(c["values_quantized"].sum()) * math.ceil(D * vq.bits / 8)
    v_params = int(c["values_quantized"].sum()) * math.ceil(D / vq.group_size) * 2 * elem
    full = int((c["keys_full"] + c["values_full"]).sum()) * D * elem
    return k_codes + k_groups * D * 2 * elem + v_codes + v_params + full


def test_nbytes_is_every_byte_held():
    # the packed payload plus int16 positions (one per entry, shared by K and V), int16 group sizes and O(S) counts
    B, H, T, D, G, R = 1, 2, 40, 16, 8, 16
    keys, values = torch.randn(B, H, T, D, dtype=torch.float16), torch.randn(B, H, T, D, dtype=torch.float16)
    keep = torch.ones(B, H, T, dtype=torch.bool)
    store = _store(2, G=G, R=R)
    store.write(
        keys, values, Plan(kivi_tiers(keep, 2, R, "keys"), kivi_tiers(keep, 2, R, "values")), torch.arange(T)[None]
    )
    S = B * H
    n_key_groups = S * (T - T % R) // G
    meta = S * T * 2 + n_key_groups * 2 + (1 + 2 * 4) * S * 8 + B * 8  # positions, group sizes, counts, last pos
    assert store.nbytes() == _packed_bytes(store, D, 2) + meta
    assert store._pos.pos.dtype == torch.int16  # the narrowest dtype for positions < 32768
    # 2-bit codes with their scales take well under the dense fp16 cache for long contexts
    long_store = _store(2, G=32, R=32)
    T2 = 1024
    k2, v2 = torch.randn(1, 2, T2, 128, dtype=torch.float16), torch.randn(1, 2, T2, 128, dtype=torch.float16)
    keep2 = torch.ones(1, 2, T2, dtype=torch.bool)
    long_store.write(
        k2, v2, Plan(kivi_tiers(keep2, 2, 32, "keys"), kivi_tiers(keep2, 2, 32, "values")), torch.arange(T2)[None]
    )
    dense = DenseStore()
    dense.write(k2, v2, Plan.from_keep(keep2), torch.arange(T2)[None])
    assert long_store.nbytes() < 0.3 * dense.nbytes()


@pytest.mark.parametrize("bits", [2, 4])
def test_held_bytes_within_3_percent_of_the_packed_size(bits):
    # SmolLM2-135M's cache shape (3 KV heads, d = 64, fp32) at 2k tokens with KIVI's G = 32, R = 128, then decode
    # steps: the overhead over codes + scales + zeros + residual is positions and counts only
    B, H, T, D, G, R = 1, 3, 2048, 64, 32, 128
    g = torch.Generator().manual_seed(bits)
    store = KIVIStore(UniformQuantizer(bits, "channel", G), UniformQuantizer(bits, "token", G), residual=R)
    keep = torch.ones(B, H, T, dtype=torch.bool)
    plan = Plan(kivi_tiers(keep, bits, R, "keys"), kivi_tiers(keep, bits, R, "values"))
    store.write(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g), plan, torch.arange(T)[None])
    for step in range(40):
        store.append(
            torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g), torch.tensor([[T + step]])
        )
        assert store.nbytes() <= 1.03 * _packed_bytes(store, D, 4)
    assert store.nbytes() > _packed_bytes(store, D, 4)  # the positions are held too


def _kivi_prefill(n_keep, G=4, R=8, D=6, dtype=torch.float32, seed=0):
    """A store after KIVI's prefill of ragged heads keeping ``n_keep[b][h]`` tokens."""
    g = torch.Generator().manual_seed(seed)
    B, H = len(n_keep), len(n_keep[0])
    T = max(max(r) for r in n_keep) + 3
    keep = torch.zeros(B, H, T, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            keep[b, h, torch.randperm(T, generator=g)[: n_keep[b][h]]] = True
    keys, values = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
    store = _store(2, G=G, R=R)
    store.write(
        keys,
        values,
        Plan(kivi_tiers(keep, 2, R, "keys"), kivi_tiers(keep, 2, R, "values")),
        torch.arange(T).expand(B, T),
    )
    return store, T


def _check_kivi_counts(store, n, R):
    c = store.entry_counts()
    assert torch.equal(c["keys_quantized"], R * torch.div(n, R, rounding_mode="floor"))
    assert torch.equal(c["keys_full"], n % R)
    assert torch.equal(c["values_quantized"], (n - R).clamp_min(0))
    assert torch.equal(c["values_full"], n.clamp_max(R))
    assert torch.equal(store.seq_lengths(), n)


def test_append_follows_kivi_residual_policies():
    R, G, D = 8, 4, 6
    n_keep = [[0, 5, 8], [13, 21, 3]]
    store, T = _kivi_prefill(n_keep, G=G, R=R, D=D)
    n = torch.tensor(n_keep)
    _check_kivi_counts(store, n, R)
    g = torch.Generator().manual_seed(5)
    kq, vq = store.key_quantizer, store.value_quantizer
    for step in range(20):
        before = store.read()
        before_q = store.entry_counts()
        k, v = torch.randn(2, 3, 1, D, generator=g), torch.randn(2, 3, 1, D, generator=g)
        store.append(k, v, torch.full((2, 1), T + step))
        n = n + 1
        _check_kivi_counts(store, n, R)
        view = store.read()
        assert bool((view.positions.gather(2, (n - 1)[..., None]) == T + step).all())  # true positions
        for b in range(2):
            for h in range(3):
                m = int(n[b, h])
                # what was quantized stays exactly as it was: nothing is re-quantized
                nq = int(before_q["keys_quantized"][b, h])
                assert torch.equal(view.keys[b, h, :nq], before.keys[b, h, :nq])
                nvq = int(before_q["values_quantized"][b, h])
                assert torch.equal(view.values[b, h, :nvq], before.values[b, h, :nvq])
                # a key block that just filled is quantized per channel in one go, from its full-precision rows
                if m % R == 0:
                    block = before.keys[b, h, m - R : m - 1]
                    block = torch.cat([block, k[b, h]])
                    assert torch.equal(view.keys[b, h, m - R : m], _roundtrip(kq, block[None])[0])
                else:  # the residual keys are the full-precision newest entries
                    assert torch.equal(view.keys[b, h, m - 1], k[b, h, 0])
                # the value that left the FIFO is quantized per token; the newest R stay exact
                if m > R:
                    old = before.values[b, h, m - R - 1]
                    assert torch.equal(view.values[b, h, m - R - 1], _roundtrip(vq, old[None, None])[0, 0])
                assert torch.equal(view.values[b, h, m - 1], v[b, h, 0])


def test_append_many_tokens_at_once_and_from_empty():
    R, G, D = 8, 4, 6
    store = _store(2, G=G, R=R)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 2 * R + 3, D, generator=g), torch.randn(1, 2, 2 * R + 3, D, generator=g)
    store.append(k, v, torch.arange(2 * R + 3)[None])
    _check_kivi_counts(store, torch.full((1, 2), 2 * R + 3), R)
    view = store.read()
    assert torch.equal(view.positions[0, 0], torch.arange(2 * R + 3))
    for j in range(2):  # two whole key blocks, quantized block by block
        blk = k[:, :, j * R : (j + 1) * R]
        assert torch.equal(view.keys[:, :, j * R : (j + 1) * R], _roundtrip(store.key_quantizer, blk))
    store.append(k[:, :, :1], v[:, :, :1], torch.tensor([[100]]))
    _check_kivi_counts(store, torch.full((1, 2), 2 * R + 4), R)


def test_crop_drops_later_positions_and_keeps_the_rest():
    R, G, D = 8, 4, 6
    store, T = _kivi_prefill([[9, 14]], G=G, R=R, D=D, seed=2)
    g = torch.Generator().manual_seed(9)
    for step in range(11):
        k, v = torch.randn(1, 2, 1, D, generator=g), torch.randn(1, 2, 1, D, generator=g)
        store.append(k, v, torch.tensor([[T + step]]))
    before = store.read()
    bytes_before = store.nbytes()
    cut = T + 3  # inside the appended tokens: cuts a quantized key block of head 1
    store.crop(cut)
    view = store.read()
    assert bool((view.positions < cut).all())
    keep = (before.positions >= 0) & (before.positions < cut)
    assert torch.equal(store.seq_lengths(), keep.sum(-1))
    for h in range(2):
        k = int(keep[0, h].sum())
        assert torch.equal(view.positions[0, h, :k], before.positions[0, h][keep[0, h]])
        assert torch.equal(view.keys[0, h, :k], before.keys[0, h][keep[0, h]])
        assert torch.equal(view.values[0, h, :k], before.values[0, h][keep[0, h]])
    assert store.nbytes() <= bytes_before
    # decoding continues after the crop
    store.append(torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D), torch.tensor([[cut]]))
    assert torch.equal(store.seq_lengths(), keep.sum(-1) + 1)
    assert int(store.read().positions.max()) == cut
    store.crop(0)
    assert int(store.seq_lengths().sum()) == 0


def test_reorder_selects_and_repeats_batch_rows():
    store, T = _kivi_prefill([[9, 14], [20, 3], [5, 5]], seed=4)
    for step in range(3):
        store.append(torch.randn(3, 2, 1, 6), torch.randn(3, 2, 1, 6), torch.full((3, 1), T + step))
    before = store.read()
    index = torch.tensor([2, 0, 2, 1])
    store.reorder(index)
    view = store.read()
    assert store.seq_lengths().shape == (4, 2)
    for i, r in enumerate(index.tolist()):
        for h in range(2):
            k = int((before.positions[r, h] >= 0).sum())
            assert torch.equal(view.positions[i, h, :k], before.positions[r, h, :k])
            assert torch.equal(view.keys[i, h, :k], before.keys[r, h, :k])
            assert torch.equal(view.values[i, h, :k], before.values[r, h, :k])
    store.append(torch.randn(4, 2, 1, 6), torch.randn(4, 2, 1, 6), torch.full((4, 1), T + 3))
    with pytest.raises(ValueError, match="index"):
        store.reorder(torch.tensor([4]))


def test_reset_frees_everything():
    store, _ = _kivi_prefill([[9, 14]])
    assert store.nbytes() > 0
    store.reset()
    assert store.nbytes() == 0
    assert store.seq_lengths().numel() == 0
    with pytest.raises(ValueError, match="empty store"):
        store.read()


def test_attention_over_the_view_ignores_padding():
    store, _ = _kivi_prefill([[9, 3]], seed=6)
    view = store.read()
    q = torch.randn(1, 4, 2, 6)
    out = view.attend(q)
    for h in range(2):  # GQA: query heads 2h, 2h+1 read KV head h
        k = int(view.valid[0, h].sum())
        sub = KVView(
            view.keys[:, h : h + 1, :k],
            view.values[:, h : h + 1, :k],
            view.positions[:, h : h + 1, :k],
            view.logit_bias[:, h : h + 1, :k],
        )
        assert torch.allclose(out[:, 2 * h : 2 * h + 2], sub.attend(q[:, 2 * h : 2 * h + 2]), atol=1e-6)


def test_is_a_kvcore_store():
    store = _store()
    assert isinstance(store, Store)
    assert store.supported_bits == frozenset({EVICT, FULL, 2})
    assert _store(4, 2).supported_bits == frozenset({EVICT, FULL, 4, 2})


def test_bad_configuration():
    with pytest.raises(ValueError, match="residual"):
        KIVIStore(UniformQuantizer(2, "channel", 32), UniformQuantizer(2, "token", 32), residual=48)
    with pytest.raises(ValueError, match="residual"):
        KIVIStore(residual=0)
    with pytest.raises(ValueError, match="value_quantizer"):
        KIVIStore(UniformQuantizer(2, "channel", 32), UniformQuantizer(2, "channel", 32), residual=64)
    with pytest.raises(TypeError, match="key_quantizer"):
        KIVIStore(key_quantizer="int2")


def test_bad_writes_and_appends():
    store = _store()
    k = torch.randn(1, 2, 5, 4)
    keep = torch.ones(1, 2, 5, dtype=torch.bool)
    pos = torch.arange(5)[None]
    with pytest.raises(ValueError, match="tiers"):
        store.write(k, k, Plan(torch.full((1, 2, 5), 4, dtype=torch.uint8)), pos)
    other = keep.clone()
    other[0, 0, 0] = False
    with pytest.raises(ValueError, match="same kept entries"):
        store.write(k, k, Plan.from_keep(keep, other), pos)
    with pytest.raises(ValueError, match="full_precision"):
        store.write(k, k, Plan(Plan.from_keep(keep).key_bits, None, torch.zeros(1, 2, 5, 4, dtype=torch.bool)), pos)
    with pytest.raises(ValueError, match="plan"):
        store.write(k, k, Plan.from_keep(keep[..., :4]), pos)
    with pytest.raises(TypeError, match="positions"):
        store.write(k, k, Plan.from_keep(keep), pos.float())
    with pytest.raises(ValueError, match="values"):
        store.write(k, k[..., :3], Plan.from_keep(keep), pos)
    with pytest.raises(TypeError, match="keys"):
        store.write(k.int(), k, Plan.from_keep(keep), pos)
    store.write(k, k, Plan.from_keep(keep), pos)
    with pytest.raises(ValueError, match="stored cache"):
        store.append(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3), torch.tensor([[5]]))
    with pytest.raises(ValueError, match="positions"):
        store.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([5]))


@pytest.mark.filterwarnings("ignore::kv_baselines.quant.KIVIUnquantizedWarning")  # full plans on purpose
def test_trailing_full_run_of_any_plan_is_the_residual():
    # an eviction-only plan (everything FULL): the last n mod R keys and the last min(n, R) values are
    # KIVI's residual; the older FULL entries stay full precision for good
    R, G, D, n = 8, 4, 6, 21
    store = _store(2, G=G, R=R)
    k, v = torch.randn(1, 1, n, D), torch.randn(1, 1, n, D)
    store.write(k, v, Plan.from_keep(torch.ones(1, 1, n, dtype=torch.bool)), torch.arange(n)[None])
    c = store.entry_counts()
    assert (int(c["keys_residual"]), int(c["values_residual"])) == (n % R, R)
    assert (int(c["keys_quantized"]), int(c["values_quantized"])) == (0, 0)
    for step in range(1, 12):
        store.append(torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D), torch.tensor([[n + step]]))
        c = store.entry_counts()
        assert int(c["keys_quantized"]) == R * ((n % R + step) // R)
        assert int(c["values_quantized"]) == step
        assert int(c["keys_full"]) == n + step - int(c["keys_quantized"])
    view = store.read()
    assert torch.equal(view.keys[0, 0, : n - n % R], k[0, 0, : n - n % R])  # permanent FULL keys untouched
    assert torch.equal(view.values[0, 0, : n - R], v[0, 0, : n - R])


def test_positions_must_identify_entries():
    store = _store()
    k = torch.randn(1, 2, 4, 4)
    keep = torch.ones(1, 2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="distinct"):
        store.write(k, k, Plan.from_keep(keep), torch.tensor([[0, 1, 1, 2]]))
    with pytest.raises(ValueError, match=">= 0"):
        store.write(k, k, Plan.from_keep(keep), torch.tensor([[-1, 0, 1, 2]]))
    # evicted tokens (e.g. left padding) may share positions
    keep[:, :, 0] = False
    store.write(k, k, Plan.from_keep(keep), torch.tensor([[1, 0, 1, 2]]))
    assert torch.equal(store.read().positions[0, 0], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="after every position held"):
        store.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([[2]]))
    with pytest.raises(ValueError, match="increasing"):
        store.append(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), torch.tensor([[5, 4]]))
    store.append(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), torch.tensor([[3, 7]]))
    store.crop(4)  # drops position 7: 4..6 may be appended again
    store.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([[4]]))
    assert store.read().positions[0, 1].tolist() == [0, 1, 2, 3, 4]


def _snapshot(store):
    v = store.read()
    return [t.clone() for t in (v.keys, v.values, v.positions, v.logit_bias, store.seq_lengths())], store.nbytes()


def _assert_unchanged(store, snap):
    (before, size), (now, now_size) = snap, _snapshot(store)
    for name, a, b in zip(("keys", "values", "positions", "bias", "lengths"), before, now):
        assert a.shape == b.shape and torch.equal(a, b), f"the failed call changed {name}"
    assert now_size == size, f"the failed call changed nbytes() {size} -> {now_size}"


def test_a_failing_residual_flush_loses_nothing():
    # a finite fp16 key whose channel range overflows the fp16 scale at 1 bit: the key block flush fails inside
    # the quantizer, after the residual took the new entry; the held entries must survive (they were emptied)
    store = KIVIStore(UniformQuantizer(1, "channel", 4), UniformQuantizer(1, "token", 4), residual=4)
    x = torch.full((1, 1, 3, 8), -65504.0, dtype=torch.float16)
    store.write(x, x, Plan.from_keep(torch.ones(1, 1, 3, dtype=torch.bool)), torch.arange(3)[None])
    snap = _snapshot(store)
    big = torch.full((1, 1, 1, 8), 65504.0, dtype=torch.float16)
    with pytest.raises(ValueError, match="range"):
        store.append(big, big, torch.tensor([[3]]))
    _assert_unchanged(store, snap)
    store.append(x[:, :, :1], x[:, :, :1], torch.tensor([[3]]))  # still usable: the failed append left no trace
    assert store.read().positions[0, 0].tolist() == [0, 1, 2, 3]


@pytest.mark.filterwarnings("ignore::kv_baselines.quant.KIVIUnquantizedWarning")  # eviction-only plans on purpose
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("what", ["keys", "values"])
def test_non_finite_entries_are_rejected_by_the_call_that_brings_them(bad, what):
    # a NaN value used to be accepted and to break a flush R appends later (and then read() as well)
    store = _store(2, G=4, R=4)
    k = torch.randn(1, 2, 6, 4)
    keep = torch.ones(1, 2, 6, dtype=torch.bool)
    store.write(k, k, Plan.from_keep(keep), torch.arange(6)[None])
    snap = _snapshot(store)
    new = {"keys": torch.randn(1, 2, 1, 4), "values": torch.randn(1, 2, 1, 4)}
    new[what][0, 1, 0, 2] = bad
    with pytest.raises(ValueError, match=f"{what} must be finite"):
        store.append(new["keys"], new["values"], torch.tensor([[6]]))
    _assert_unchanged(store, snap)
    kk, vv = k.clone(), k.clone()
    (kk if what == "keys" else vv)[0, 0, 3, 1] = bad
    with pytest.raises(ValueError, match=f"{what} \\(kept entries\\) must be finite"):
        store.write(kk, vv, Plan.from_keep(keep), torch.arange(6)[None])
    _assert_unchanged(store, snap)
    keep[0, :, 3] = False  # a non-finite entry the plan evicts is never held
    store.write(kk, vv, Plan.from_keep(keep), torch.arange(6)[None])
    assert bool(torch.isfinite(store.read().keys).all() & torch.isfinite(store.read().values).all())


@pytest.mark.filterwarnings("ignore::kv_baselines.quant.KIVIUnquantizedWarning")  # eviction-only plans on purpose
def test_failing_mutations_leave_the_store_unchanged():
    store = _store(2, G=4, R=4)
    k = torch.randn(2, 2, 9, 4)
    store.write(k, k, Plan.from_keep(torch.ones(2, 2, 9, dtype=torch.bool)), torch.arange(9).expand(2, 9))
    store.append(k[:, :, :3], k[:, :, :3], torch.arange(9, 12).expand(2, 3))  # quantized units + residuals held
    snap = _snapshot(store)
    bad = [
        lambda: store.append(k[:, :, :1], k[:, :, :1], torch.tensor([[12], [11]])),  # not after the held row 1
        lambda: store.write(k, k, Plan.from_keep(torch.ones(2, 2, 9, dtype=torch.bool)), torch.zeros(2, 9).long()),
        lambda: store.reorder(torch.tensor([0.0, 1.0])),
        lambda: store.reorder(torch.tensor([0, 2])),
        lambda: store.crop(2.5),
        lambda: store.retier(Plan(torch.full_like(store.tiers().key_bits, FULL))),
    ]
    for call in bad:
        with pytest.raises((ValueError, TypeError)):
            call()
        _assert_unchanged(store, snap)
