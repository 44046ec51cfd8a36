"""HqeKV kernels: fused mixed-tier decode attention, its reduced attention row, block transcode and window importance.

Each Triton kernel runs under ``TRITON_INTERPRET=1`` on CPU (set by conftest) with small shapes and few programs,
and is compared with its PyTorch reference; the references are compared with what the store reads back.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_hqekv import HqeKVStore, tier_quantizer, window_importance_ref
from kv_hqekv.attention import attention_row, mixed_tier_attention, tier_pair_attention, tiered_sides
from kv_hqekv.kernels import TieredSide, dequantize_side_ref, tiered_attention_row_ref, transcode_ref
from kv_hqekv.part_attention import _codes, _Columns, _key_entries, part_attention
from kvcodec.packing import unpack_unchecked
from kvcodec.stats import expand_groups
from kvcore import EVICT, FULL, KVView, Plan, merge_attention, reference_attention

TIERS = torch.tensor([FULL, 4, 2, 1], dtype=torch.uint8)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels run compiled on a GPU


def _to(x, device=DEVICE):
    """``x`` (a tensor, a dict of them, or a dataclass of them such as a TieredSide) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    if dataclasses.is_dataclass(x):
        return type(x)(**{f.name: _to(getattr(x, f.name), device) for f in dataclasses.fields(x) if f.init})
    return x


def _plan(g, B, H, T, G, key_tiers=TIERS, value_tiers=None, evict_keys=True):
    """Block-aligned random key and value tiers (values may be evicted under kept keys)."""
    value_tiers = (
        torch.cat([key_tiers, torch.tensor([EVICT], dtype=torch.uint8)]) if value_tiers is None else value_tiers
    )
    nb = -(-T // G)
    kb = key_tiers[torch.randint(len(key_tiers), (B, H, nb), generator=g)].repeat_interleave(G, -1)[..., :T]
    vb = value_tiers[torch.randint(len(value_tiers), (B, H, nb), generator=g)].repeat_interleave(G, -1)[..., :T]
    if evict_keys and nb > 1:
        kb[0, 0, :G] = EVICT  # a ragged head
    return Plan(kb.contiguous(), vb.contiguous())


def _store(g, B=1, H=2, T=24, D=16, G=4, dtype=torch.float32, **kw):
    store = HqeKVStore(block=G)
    k, v = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
    store.write(k, v, _plan(g, B, H, T, G, **kw), torch.arange(T).expand(B, T))
    return store


def _decoded_after_retier(g):
    """A store written, extended by 4 decode tokens, re-tiered (fp16 -> 4 bits, 4-bit values -> 1 bit, one entry
    per head evicted) and extended by one more token: decode positions past the prefill in every part."""
    decoded = _store(g, evict_keys=False)
    for t in range(24, 28):
        decoded.append(
            torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g), torch.tensor([[t]])
        )
    held = decoded.tiers()
    kb = torch.where(held.key_bits == FULL, torch.tensor(4, dtype=torch.uint8), held.key_bits)  # fp16 -> 4 bits
    kb[..., 1] = EVICT
    vb = torch.where(held.bits_for_values == 4, torch.tensor(1, dtype=torch.uint8), held.bits_for_values)
    decoded.retier(Plan(kb, vb))
    decoded.append(torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g), torch.tensor([[28]]))
    return decoded


def _row_from_view(view: KVView, q: torch.Tensor, scale: float, lse: torch.Tensor) -> torch.Tensor:
    B, H, T, _ = view.keys.shape
    Hq, Q = q.shape[1], q.shape[2]
    k = view.keys.float().repeat_interleave(Hq // H, 1)
    logits = q.float() @ k.transpose(-1, -2) * scale + view.logit_bias.float().repeat_interleave(Hq // H, 1)[:, :, None]
    p = torch.exp(logits - lse[..., None])
    return p.view(B, H, Hq // H, Q, T).sum((2, 3))


# -- fused attention: the store's path (the reference on CPU) -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attend_equals_reference_over_read(dtype):
    """attend() = reference attention over the dequantized read() view: every (key tier, value tier) pair, values
    evicted under kept keys, a ragged head, GQA (4 query heads per KV head), two query rows."""
    g = torch.Generator().manual_seed(1)
    store = _store(g, B=2, H=2, T=48, D=32, G=8, dtype=dtype)
    q = torch.randn(2, 8, 2, 32, generator=g).to(dtype)
    out, lse = store.attend(q)
    ref_out, ref_lse = reference_attention(store.read(), q)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    pair_out, pair_lse = tier_pair_attention(store, q)  # the earlier per-tier-pair path agrees
    torch.testing.assert_close(out, pair_out, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(lse, pair_lse, atol=1e-3, rtol=1e-4)


def test_attend_with_empty_tiers_single_token_and_after_retier():
    """Tiers absent from the store (only fp16 + 2-bit keys, no 4/1-bit values), a store of a single appended token,
    and decode positions after re-tiering (demote + evict, then append) all match the reference."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 1, 16, generator=g)
    sparse = _store(
        g, key_tiers=torch.tensor([FULL, 2], dtype=torch.uint8), value_tiers=torch.tensor([2, FULL], dtype=torch.uint8)
    )
    one = HqeKVStore(block=4)
    one.append(torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g), torch.tensor([[7]]))
    decoded = _decoded_after_retier(g)
    assert decoded.tier_counts()["keys_16"].sum() == 2 and decoded.seq_lengths().tolist() == [[28, 28]]
    for store in (sparse, one, decoded):
        out, lse = store.attend(q)
        ref_out, ref_lse = reference_attention(store.read(), q)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), T=st.integers(1, 40), group=st.sampled_from([1, 2, 3]))
def test_attend_property(seed, T, group):
    """For any block-aligned mix of tiers (K and V ranked separately), context length and GQA group, the fused
    attend equals softmax(q·K̂ᵀ/√d)·V̂ over the dequantized view, and the reduced row sums to group × Q per head."""
    g = torch.Generator().manual_seed(seed)
    store = _store(g, B=1, H=2, T=T, D=8, G=4)
    q = torch.randn(1, 2 * group, 1, 8, generator=g)
    out, lse, row = mixed_tier_attention(store, q, return_row=True)
    ref_out, ref_lse = reference_attention(store.read(), q)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    seen = store.seq_lengths() > 0
    expected = torch.where(seen, float(group), 0.0)
    torch.testing.assert_close(row.sum(-1), expected, atol=1e-4, rtol=1e-5)


def test_attention_row_under_a_merged_lse():
    """attention_row(store, q, lse) with the lse of the attention merged with the step's own token is the model's
    true attention row over the held entries: equal to the probabilities of the reference over read() + new token."""
    g = torch.Generator().manual_seed(3)
    store = _store(g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    own = KVView(
        torch.randn(1, 2, 1, 16, generator=g),
        torch.randn(1, 2, 1, 16, generator=g),
        torch.full((1, 2, 1), 24),
        torch.zeros(1, 2, 1),
    )
    _, lse = merge_attention([store.attend(q), reference_attention(own, q)])
    row = attention_row(store, q, lse)
    expected = _row_from_view(store.read(), q, 16**-0.5, lse)
    torch.testing.assert_close(row, expected, atol=1e-5, rtol=1e-5)
    assert bool((row.sum(-1) < 2.0).all())  # the new token takes some of the mass
    with pytest.raises(ValueError, match="lse must be"):
        attention_row(store, q, lse[..., None])


# -- fused attention: the Triton kernel under the interpreter --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_tiered_attention_equals_reference(dtype):
    """The Triton kernel (three splits of 16-entry tiles, GQA 2, two query rows) equals the reference, output,
    lse and the reduced row, on a store with every tier pair, evicted values and a ragged head."""
    pytest.importorskip("triton")
    from kv_hqekv.kernels.triton_attention import tiered_attention_row_triton, tiered_attention_triton

    g = torch.Generator().manual_seed(4)
    store = _store(g, T=40, dtype=dtype)
    keys, values = tiered_sides(store)
    q = torch.randn(1, 4, 2, 16, generator=g).to(dtype)
    out, lse = _to(tiered_attention_triton(_to(q), _to(keys), _to(values), 0.25, block_t=16, tiles=1), "cpu")
    ref_out, ref_lse = reference_attention(store.read(), q, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    row = tiered_attention_row_triton(_to(q), _to(keys), 0.25, _to(ref_lse), block_t=16, tiles=1).cpu()
    torch.testing.assert_close(row, tiered_attention_row_ref(q, keys, 0.25, ref_lse), atol=1e-6, rtol=1e-5)


def test_triton_tiered_attention_on_the_matrix_units_in_float16():
    """The cache-dtype path (float16 query and cache on tl.dot, probabilities split into two float16 parts) stays
    within float32-level error of the reference (one cast of p would be off by ~1e-3); a float32 query with
    tensor_cores=True is refused. (The bfloat16 twin runs on GPUs only: the interpreter's bfloat16 tl.dot is
    wrong.)"""
    pytest.importorskip("triton")
    from kv_hqekv.kernels.triton_attention import tiered_attention_triton

    g = torch.Generator().manual_seed(12)
    store = _store(g, T=40, dtype=torch.float16)
    keys, values = tiered_sides(store)
    q = (torch.randn(1, 4, 1, 16, generator=g) * 3).to(torch.float16)
    out, lse = _to(tiered_attention_triton(_to(q), _to(keys), _to(values), 0.25, tensor_cores=True), "cpu")
    ref_out, ref_lse = reference_attention(store.read(), q, 0.25)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="tensor_cores"):
        tiered_attention_triton(_to(q.float()), _to(keys), _to(values), 0.25, tensor_cores=True)


def test_triton_tiered_attention_after_retier():
    """The Triton kernel over a re-tiered store with decode tokens (one split of 32-entry tiles) = the reference."""
    pytest.importorskip("triton")
    from kv_hqekv.kernels.triton_attention import tiered_attention_triton

    g = torch.Generator().manual_seed(8)
    store = _decoded_after_retier(g)
    q = torch.randn(1, 2, 1, 16, generator=g)
    out, lse = _to(tiered_attention_triton(_to(q), *_to(tiered_sides(store)), 0.25, block_t=32, tiles=1), "cpu")
    ref_out, ref_lse = reference_attention(store.read(), q, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


# -- transcode ------------------------------------------------------------------------------------------------------
def _units(side: TieredSide, U: int) -> TieredSide:
    """The side's entries regrouped as units of ``U`` consecutive entries (every entry held)."""
    return TieredSide(
        side.full,
        side.tiers,
        *(t.reshape(-1, U) for t in (side.tier, side.row, side.group)),
        side.axis,
        side.group_size,
    )


@pytest.mark.parametrize("bits", [4, 2, 1])
def test_transcode_reference_is_dequantize_then_quantize(bits):
    """transcode_ref of held keys (units of G entries, per channel) and values (per token) = the tier quantizer
    applied to what read() returns for those entries: the transcode starts from the held representation."""
    g = torch.Generator().manual_seed(5)
    store = _store(g, T=16, D=8, evict_keys=False, value_tiers=TIERS)
    keys, values = tiered_sides(store)
    view = store.read()
    for side, x, kind, U in ((keys, view.keys, "key", 4), (values, view.values, "value", 1)):
        q = transcode_ref(_units(side, U), bits, side.axis, 4)
        expected = tier_quantizer(bits, kind, 4).quantize(x.reshape(-1, U, 8))
        assert torch.equal(q.codes, expected.codes) and torch.equal(q.scales, expected.scales)
        assert torch.equal(q.zeros, expected.zeros)
        assert torch.equal(dequantize_side_ref(side), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_transcode_equals_reference(dtype):
    """Triton transcode = reference: uniform 4/2-bit bit for bit; normalized 1-bit statistics within float32 rounding
    of the summation order (one step of the
    cache dtype) and codes equal wherever the entry is not within that rounding of the group mean."""
    pytest.importorskip("triton")
    from kv_hqekv.kernels.triton_transcode import transcode_triton

    g = torch.Generator().manual_seed(6)
    store = _store(g, T=8, D=24, evict_keys=False, value_tiers=TIERS, dtype=dtype)
    keys, values = tiered_sides(store)
    for side, U in ((keys, 4), (values, 1)):
        src = _units(side, U)
        for bits in (4, 2, 1):
            got = _to(transcode_triton(_to(src), bits, side.axis, 4, block_r=8), "cpu")
            ref = transcode_ref(src, bits, side.axis, 4)
            assert got.scales.dtype == ref.scales.dtype and got.shape == ref.shape
            if bits > 1:
                assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
                assert torch.equal(got.zeros, ref.zeros)
                continue
            # one rounding step of the stored statistics, or for float32 statistics the summation-order bound of
            # the 4-term groups (the GPU's tree reduction and the reference's sum round differently)
            ulp = max(torch.finfo(dtype).eps, 4 * torch.finfo(torch.float32).eps)
            torch.testing.assert_close(got.scales, ref.scales, atol=0, rtol=ulp)
            torch.testing.assert_close(got.zeros, ref.zeros, atol=1e-6, rtol=ulp)
            x = dequantize_side_ref(src).float()
            mean = expand_groups(ref.zeros.float(), side.axis, 4, U, 24)
            far = (x - mean).abs() > 1e-4  # not within float rounding of the group mean (the 1-bit bound)
            got_codes, ref_codes = unpack_unchecked(got.codes, 1, 24), unpack_unchecked(ref.codes, 1, 24)
            assert bool(far.float().mean() > 0.9) and torch.equal(got_codes[far], ref_codes[far])


# -- window importance ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True])
def test_triton_window_importance_equals_reference(masked):
    """The tiled kernel (8-key tiles, two per program, several splits) = window_importance_ref: causal window of 5
    queries, GQA 2, padding excluded, normalized and plain sums, and a context exactly as long as the window; with
    rows 16-aligned (the kernel is told so and reads rows as vectors) and views of padded buffers (it is not)."""
    pytest.importorskip("triton")
    from kv_hqekv.kernels.triton_importance import window_importance_triton

    def padded(x):  # the same values in a buffer whose rows are 19 wide: strides not multiples of 16
        buf = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
        buf[..., : x.shape[-1]] = x
        return buf[..., : x.shape[-1]]

    g = torch.Generator().manual_seed(7)
    for B, Hq, H, m, N in ((2, 4, 2, 5, 37), (1, 2, 1, 6, 6)):
        q, k = torch.randn(B, Hq, m, 16, generator=g), torch.randn(B, H, N, 16, generator=g)
        valid = (torch.rand(B, N, generator=g) > 0.3) if masked else None
        for normalize in (True, False):
            # float32 (IEEE products) and float16 on the matrix units (where aligned rows are hinted)
            for dtype, tc, tol in ((torch.float32, None, 1e-5), (torch.float16, True, 2e-3)):
                qd, kd = q.to(dtype), k.to(dtype)
                want = window_importance_ref(qd.float(), kd.float(), valid, normalize)
                for qq, kk in ((qd, kd), (padded(qd), padded(kd))):
                    got = window_importance_triton(
                        _to(qq), _to(kk), _to(valid), normalize, block_n=16, tiles=2, tensor_cores=tc
                    ).cpu()
                    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_bad_input_names_the_argument():
    """Malformed kernel descriptions and arguments raise errors naming what is wrong."""
    from kv_hqekv.kernels import TierCodes

    g = torch.Generator().manual_seed(9)
    store = _store(g)
    keys, _ = tiered_sides(store)
    with pytest.raises(TypeError, match="tier must be uint8"):
        TieredSide(keys.full, keys.tiers, keys.tier.int(), keys.row, keys.group, "channel", 4)
    with pytest.raises(ValueError, match="row must be int32"):
        TieredSide(keys.full, keys.tiers, keys.tier, keys.row.long(), keys.group, "channel", 4)
    with pytest.raises(ValueError, match=r"tiers\[4\]"):
        TieredSide(keys.full, {4: keys.tiers[2]}, keys.tier, keys.row, keys.group, "channel", 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        TierCodes(torch.zeros(1, 2, dtype=torch.uint8), torch.zeros(1, 16), torch.zeros(1, 16), 8)
    with pytest.raises(ValueError, match="codebook must hold 2 levels"):
        TierCodes(torch.zeros(1, 2, dtype=torch.uint8), torch.zeros(1, 16), torch.zeros(1, 16), 1, torch.zeros(3))
    with pytest.raises(TypeError, match="return_row must be a bool"):
        mixed_tier_attention(store, torch.randn(1, 2, 1, 16), return_row=1)
    with pytest.raises(ValueError, match="query must be"):
        store.attend(torch.randn(1, 3, 1, 16))


# -- the CPU path: attention part by part (kv_hqekv.part_attention) -------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("by_position", [True, False])
def test_part_attention_both_column_layouts_equal_reference(dtype, by_position):
    """Columns by position (no sort; evicted positions left empty) and by read() slot give the reference attention
    over read(): every tier pair, values evicted under kept keys, a ragged head, GQA, the uniform 1-bit ablation, and
    a decoded store whose units lost rows (eviction after re-tiering: the partial-unit layout)."""
    g = torch.Generator().manual_seed(5)
    stores = [_store(g, B=2, H=2, T=48, D=32, G=8, dtype=dtype), _decoded_after_retier(g)]
    uniform = HqeKVStore(block=4, one_bit="uniform")
    k, v = torch.randn(1, 2, 24, 16, generator=g).to(dtype), torch.randn(1, 2, 24, 16, generator=g).to(dtype)
    uniform.write(k, v, _plan(g, 1, 2, 24, 4), torch.arange(24)[None])
    stores.append(uniform)
    for store in stores:
        B, H, D = store._shape
        q = torch.randn(B, 4 * H, 2, D, generator=g).to(dtype)
        out, lse = part_attention(store, q, D**-0.5, by_position=by_position)
        ref_out, ref_lse = reference_attention(store.read(), q)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_part_attention_sparse_positions_take_the_sorted_layout():
    """Positions spread far apart (a span much larger than the entries held) are laid out by read() slot, not by
    position, and still give the reference attention."""
    g = torch.Generator().manual_seed(6)
    store = HqeKVStore(block=4)
    k, v = torch.randn(1, 2, 24, 16, generator=g), torch.randn(1, 2, 24, 16, generator=g)
    store.write(k, v, _plan(g, 1, 2, 24, 4), (torch.arange(24) * 1000)[None])
    seg, pos, _ = _key_entries(store, torch.zeros(2, 1, 16), 1.0)
    assert not _Columns(seg, pos, 2).by_position
    q = torch.randn(1, 4, 1, 16, generator=g)
    out, lse = store.attend(q)
    ref_out, ref_lse = reference_attention(store.read(), q)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("D", [8, 24, 64])
def test_part_attention_codes_word_wise_and_byte_wise(bits, D):
    """The codes unpacked for the CPU path equal kvcodec's unpack, whether rows are read as 32-bit words (a row a
    whole number of words) or byte-wise (D 8 at 1 or 2 bits, D 24 at 1 bit: rows of 1-3 bytes)."""
    g = torch.Generator().manual_seed(7)
    store = HqeKVStore(block=4)
    tiers = torch.tensor([bits], dtype=torch.uint8)
    k, v = torch.randn(1, 2, 16, D, generator=g), torch.randn(1, 2, 16, D, generator=g)
    store.write(
        k, v, _plan(g, 1, 2, 16, 4, key_tiers=tiers, value_tiers=tiers, evict_keys=False), torch.arange(16)[None]
    )
    for kind in ("k", "v"):
        units = store._parts[kind][(4, 2, 1).index(bits) + 1]
        want = unpack_unchecked(units.codes[: units.nr], bits, D).float()
        torch.testing.assert_close(_codes(units, D, "test"), want, atol=0, rtol=0)


# -- re-tiering through the transcode kernel ------------------------------------------------------------------------
def _demoting_plan(store):
    """Every block's key and value moved one tier down (fp16 -> 4 -> 2 -> 1; 1-bit entries stay)."""
    held = store.tiers()
    down = {FULL: 4, 4: 2, 2: 1, 1: 1, EVICT: EVICT}
    kb = held.key_bits.clone().apply_(lambda t: down[t])
    vb = held.bits_for_values.clone().apply_(lambda t: down[t])
    return Plan(kb, vb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_retier_demotes_from_the_held_representation(dtype):
    """A demoted block reads back exactly as its held (dequantized) entries quantized at the new tier — per block of
    G keys (per channel) and per value token — and every entry that stays keeps its bytes."""
    g = torch.Generator().manual_seed(8)
    G = 4
    store = HqeKVStore(block=G)
    k, v = torch.randn(1, 2, 16, 8, generator=g).to(dtype), torch.randn(1, 2, 16, 8, generator=g).to(dtype)
    store.write(k, v, _plan(g, 1, 2, 16, G, evict_keys=False), torch.arange(16)[None])
    before, held = store.read(), store.tiers()
    plan = _demoting_plan(store)
    store.retier(plan)
    after = store.read()
    for name, x_before, x_after, bits_before, bits_after in (
        ("key", before.keys, after.keys, held.key_bits, plan.key_bits),
        ("value", before.values, after.values, held.bits_for_values, plan.bits_for_values),
    ):
        U = G if name == "key" else 1
        for h in range(2):
            for start in range(0, 16, U):
                blk = slice(start, start + U)
                old, new = int(bits_before[0, h, start]), int(bits_after[0, h, start])
                if old == new or new == EVICT:
                    assert torch.equal(x_after[0, h, blk], x_before[0, h, blk]), (name, h, start)
                    continue
                quant = tier_quantizer(new, name, G)
                want = quant.dequantize(quant.quantize(x_before[0, h, blk][None]))[0]
                assert torch.equal(x_after[0, h, blk], want), (name, h, start, old, new)


def test_retier_through_the_triton_transcode_equals_the_reference(monkeypatch):
    """The store's demotions with the Triton transcode kernel (under the interpreter) hold the same codes as with
    its PyTorch reference: 4- and 2-bit targets bit for bit (the 1-bit target is checked kernel-level above)."""
    pytest.importorskip("triton")
    import kv_hqekv.store as store_module
    from kv_hqekv.kernels.triton_transcode import transcode_triton

    g = torch.Generator().manual_seed(9)
    G = 4
    stores = [HqeKVStore(block=G), HqeKVStore(block=G)]
    k, v = torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g)
    tiers = torch.tensor([FULL, 4, 2], dtype=torch.uint8)
    plan = _plan(g, 1, 2, 16, G, key_tiers=tiers, value_tiers=tiers, evict_keys=False)
    for s in stores:
        s.write(k, v, plan, torch.arange(16)[None])
    held = stores[0].tiers()
    down = {FULL: 2, 4: 2, 2: 2}
    demote = Plan(*(t.clone().apply_(lambda b: down[b]) for t in (held.key_bits, held.bits_for_values)))
    stores[0].retier(demote)
    calls = []

    def triton_transcode(side, bits, axis, group_size):
        calls.append(bits)
        return _to(transcode_triton(_to(side), bits, axis, group_size, block_r=8), "cpu")

    monkeypatch.setattr(store_module, "transcode", triton_transcode)
    stores[1].retier(demote)
    assert calls
    for kind in ("k", "v"):
        ref, got = stores[0]._parts[kind][2], stores[1]._parts[kind][2]  # the 2-bit tier
        assert torch.equal(got.codes[: got.nr], ref.codes[: ref.nr])
        assert torch.equal(got.scales[: got.nu], ref.scales[: ref.nu])
        assert torch.equal(got.zeros[: got.nu], ref.zeros[: ref.nu])
    assert torch.equal(stores[1].read().keys, stores[0].read().keys)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    T=st.integers(1, 45),
    steps=st.integers(0, 6),
    retier=st.booleans(),
)
def test_tiered_sides_lay_every_entry_out_like_read(seed, B, H, T, steps, retier):
    """Invariant: the maps of ``tiered_sides`` (one sort of the key entries, one search for the values) put every
    held entry where ``read()`` puts it: the tier maps equal ``tiers()`` (0 where a value is evicted under its kept
    key, and past a short head's end) and the rows they point to dequantize to ``read()``'s keys and values -- over
    ragged heads, decode appends and a re-tier that demotes."""
    g = torch.Generator().manual_seed(seed)
    store = _store(g, B=B, H=H, T=T, G=4)
    D = store._shape[2]
    for i in range(steps):
        kv = torch.randn(2, B, H, 1, D, generator=g)
        store.append(kv[0], kv[1], torch.full((B, 1), T + i))
    if retier:
        held = store.tiers()
        down = torch.where(held.key_bits == FULL, torch.full_like(held.key_bits, 4), held.key_bits)
        store.retier(Plan(down, torch.where(held.bits_for_values == 4, 1, held.bits_for_values).to(torch.uint8)))
    keys, values = tiered_sides(store)
    held, view = store.tiers(), store.read()
    assert store.held_max_length() == int(store.seq_lengths().max())  # kept on the host through the appends
    assert torch.equal(keys.tier, held.key_bits) and torch.equal(values.tier, held.bits_for_values)
    assert torch.equal(dequantize_side_ref(keys), view.keys) and torch.equal(dequantize_side_ref(values), view.values)


def test_a_decode_step_on_the_fused_path_reads_nothing_on_the_host(monkeypatch):
    """Between re-plans a decode step (append, then the fused attention over the tier maps) reads no tensor value on
    the host with the value checks off, as on a GPU: the maps' width is kept on the host through appends and the
    positions are held in int32 unread. (Forced onto the Triton path here; the interpreter computes it.)"""
    pytest.importorskip("triton")
    from kv_hqekv import attention
    from kv_hqekv.kernels import dispatch
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    g = torch.Generator().manual_seed(8)
    store = _store(g, T=40)
    monkeypatch.setattr(attention, "use_triton", lambda t: True)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    q = torch.randn(1, 4, 1, 16, generator=g)
    with value_checks(False):
        store.append(torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g), torch.tensor([[40]]))
        store.attend(q)  # learns the longest head once after the write
        with HostReads(sites=True) as reads:
            for t in range(41, 44):
                kv = torch.randn(2, 1, 2, 1, 16, generator=g)
                store.append(kv[0], kv[1], torch.tensor([[t]]))
                out, lse = store.attend(q)
    assert reads.total == 0, dict(reads.by_site)
    ref_out, ref_lse = reference_attention(store.read(), q)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def _blocked_store(g, B, H, blocks, tail, G=4, D=16, steps=0):
    """A store of ``blocks`` whole blocks and ``tail`` full rows per head (random tiers per block, a head with a
    block evicted), extended by ``steps`` decode tokens."""
    T = blocks * G + tail
    plan = _plan(g, B, H, blocks * G, G)
    full = torch.full((B, H, tail), FULL, dtype=torch.uint8)
    store = HqeKVStore(block=G)
    k, v = torch.randn(2, B, H, T, D, generator=g)
    plan = Plan(torch.cat([plan.key_bits, full], -1), torch.cat([plan.bits_for_values, full], -1))
    store.write(k, v, plan, torch.arange(T).expand(B, T))
    for i in range(steps):
        kv = torch.randn(2, B, H, 1, D, generator=g)
        store.append(kv[0], kv[1], torch.full((B, 1), T + i))
    return store


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    blocks=st.integers(0, 6),
    tail=st.integers(0, 6),
    before=st.integers(0, 3),
    after=st.integers(0, 5),
)
def test_the_block_layout_stands_for_the_per_entry_maps(seed, B, H, blocks, tail, before, after):
    """Invariant: a store of whole blocks has a block layout (``decode_layout``), and the per-entry maps it stands
    for -- taken after ``before`` decode tokens and advanced through ``after`` more -- are the maps
    ``tiered_sides`` builds (tiers everywhere, rows and parameter rows wherever an entry is held), so attention over
    it (reference, and the Triton kernel under the interpreter) equals reference attention over ``read()``."""
    from hypothesis import assume

    from kv_hqekv.kernels import blocked_attention_ref, expand_side
    from kv_hqekv.kernels.triton_attention import blocked_attention_triton

    assume(blocks + tail > 0)
    g = torch.Generator().manual_seed(seed)
    store = _blocked_store(g, B, H, blocks, tail, steps=before)
    assert store.decode_layout() is not None
    for i in range(after):
        kv = torch.randn(2, B, H, 1, 16, generator=g)
        store.append(kv[0], kv[1], torch.full((B, 1), 100 + i))
    layout, keys, values = store.decode_layout()
    assert layout.appended == after and layout.width == store.held_max_length()
    for got, want in zip((keys, values), tiered_sides(store)):
        got = expand_side(layout, got)
        assert torch.equal(got.tier, want.tier)
        held = want.tier != 0
        assert torch.equal(got.row[held], want.row[held])
        coded = held & (want.tier != FULL)
        assert torch.equal(got.group[coded], want.group[coded])
    q = torch.randn(B, 2 * H, 1, 16, generator=g)
    ref_out, ref_lse = reference_attention(store.read(), q)
    for fn in (blocked_attention_ref, blocked_attention_triton):
        out, lse = fn(q, layout, keys, values, 0.25)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_a_cache_not_in_whole_blocks_has_no_block_layout_and_edits_retake_it(monkeypatch):
    """A quantized block cut short (here by a crop inside it) leaves no block layout, and the fused path falls back
    to the per-entry maps with the same result; a re-tier, crop or reorder takes the layout again (never the one
    before the edit)."""
    pytest.importorskip("triton")
    from kv_hqekv import attention
    from kv_hqekv.kernels import dispatch

    monkeypatch.setattr(attention, "use_triton", lambda t: True)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    g = torch.Generator().manual_seed(3)
    store = _blocked_store(g, 1, 2, blocks=4, tail=0)
    q = torch.randn(1, 4, 1, 16, generator=g)
    first = store.decode_layout()
    assert first is not None
    store.crop(14)  # cuts the fourth block (positions 12-15) to two entries
    assert store.decode_layout() is None
    out, lse = store.attend(q)
    ref_out, ref_lse = reference_attention(store.read(), q)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    store.crop(12)  # back to whole blocks
    again = store.decode_layout()
    assert again is not None and again[0].width == 12 and again[0] is not first[0]
    store.reorder(torch.tensor([0, 0]))
    layout = store.decode_layout()[0]
    assert tuple(layout.blocks.shape) == (2, 2)
    out, lse = store.attend(q.expand(2, 4, 1, 16))
    ref_out, ref_lse = reference_attention(store.read(), q.expand(2, 4, 1, 16))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_the_kept_block_layout_holds_only_its_maps():
    """What the store keeps for its block layout is counted by ``nbytes`` and is only the block maps: no stale full
    rows survive the appends that replace them (the bytes above the store without a layout are constant)."""
    g = torch.Generator().manual_seed(5)
    store = _blocked_store(g, 1, 2, blocks=5, tail=3)
    layout, keys, values = store.decode_layout()
    kept = [layout.blocks, layout.held, keys.tier, keys.row, keys.group, keys.tail]
    kept += [values.tier, values.row, values.tail]
    extra = sum(t.numel() * t.element_size() for t in kept)
    for i in range(4):
        kv = torch.randn(2, 1, 2, 1, 16, generator=g)
        store.append(kv[0], kv[1], torch.tensor([[30 + i]]))
        blocks = store._blocks
        store._blocks = None
        without = store.nbytes()
        store._blocks = blocks
        assert store.nbytes() - without == extra


@pytest.mark.parametrize(
    ("B", "H", "blocks", "tail", "after", "padded"), [(1, 2, 4, 3, 2, False), (2, 2, 6, 0, 5, True)]
)
def test_window_importance_over_the_block_layout_equals_it_over_the_dense_keys(B, H, blocks, tail, after, padded):
    """The window importance read from the held codes (keys dequantized in registers through the block layout)
    equals the reference over the dense keys ``held_keys`` writes out, with and without padding columns; tiles of
    8 keys, two per program, several programs."""
    from kv_hqekv.importance import window_importance_blocked_ref
    from kv_hqekv.kernels.triton_importance import window_importance_blocked_triton
    from kv_hqekv.window import held_keys

    g = torch.Generator().manual_seed(blocks + tail)
    store = _blocked_store(g, B, H, blocks, tail, steps=1)
    store.decode_layout()
    for i in range(after):
        kv = torch.randn(2, B, H, 1, 16, generator=g)
        store.append(kv[0], kv[1], torch.full((B, 1), 100 + i))
    layout, keys, _ = store.decode_layout()
    dense, pos = held_keys(store)
    valid = pos[:, 0] >= 0
    if padded:
        valid[-1, :3] = False
    q = torch.randn(B, 2 * H, 5, 16, generator=g)
    want = window_importance_ref(q, dense, valid)
    torch.testing.assert_close(window_importance_blocked_ref(q, layout, keys, valid), want)
    got = window_importance_blocked_triton(_to(q), _to(layout), _to(keys), _to(valid), block_n=8, tiles=2).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
