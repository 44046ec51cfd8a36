"""Triton kernels == their PyTorch references, under ``TRITON_INTERPRET=1`` on CPU (conftest.py), compiled on CUDA."""

import dataclasses
import math

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest.py set TRITON_INTERPRET=1 first when CUDA is absent

from kv_hex.kernels import reference
from kv_hex.kernels.reference import attention_column_sums
from kv_hex.kernels.triton_colsum import attention_column_sums_triton
from kv_hex.layout import segment_layout
from kv_hex.uniform import as_part_layout, uniform_part
from kvcore import Plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("B", "H", "G", "T", "W"), [(1, 1, 1, 20, 20), (2, 2, 2, 37, 9), (1, 2, 4, 16, 3)])
def test_column_sums_kernel_equals_reference(B, H, G, T, W):
    g = torch.Generator().manual_seed(T + W)
    q = torch.randn(B, H * G, W, 16, generator=g).to(DEVICE)
    k = torch.randn(B, H, T, 16, generator=g).to(DEVICE)
    valid = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    if B > 1:
        valid[1, :5] = False  # left padding
    want = attention_column_sums(q, k, valid, 1 / math.sqrt(16))
    got = attention_column_sums_triton(q, k, valid, 1 / math.sqrt(16))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_column_sums_kernel_refuses_odd_head_dims():
    q, k = torch.randn(1, 1, 2, 12), torch.randn(1, 1, 2, 12)
    with pytest.raises(ValueError, match="head dim"):
        attention_column_sums_triton(q, k, torch.ones(1, 2, dtype=torch.bool), 0.3)


@pytest.mark.parametrize(
    ("axis", "dtype", "bits"),
    [
        ("channel", torch.float16, 3),
        ("token", torch.float16, 4),
        ("channel", torch.float32, 4),
        ("token", torch.float32, 3),
    ],
)
def test_kcvt_kernel_equals_reference(axis, dtype, bits):
    """Masked statistics (a third of the entries masked, one group fully masked), codes, scales, zeros: identical."""
    from kv_hex.kernels.reference import kcvt_codes
    from kv_hex.kernels.triton_kcvt import kcvt_codes_triton

    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(2, 40, 48, generator=g) * 3).to(dtype).to(DEVICE)
    use = (torch.rand(2, 40, 48, generator=g) > 1 / 3).to(DEVICE)
    use[0, :, 0] = False
    use[1, 0, :] = False
    want = kcvt_codes(x, use, bits, axis)
    got = kcvt_codes_triton(x, use, bits, axis)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -- dequantize + overlay merge, fused decode attention over one part -------------------------------------------
def hex_store(dtype, bits, value_scope, mask_scope, mask_kind, ragged=False):
    """A small HEX layer on DEVICE holding two segments (a prefill, one decode block) and a residual."""
    from kv_hex import HEXConfig, HEXStore, hex_tiers
    from kvcore import Plan

    cfg = HEXConfig(bits=bits, block_size=8, recent=1, heavy_ratio=0.2, rho=0.125, value_scope=value_scope,
                    mask_scope=mask_scope, mask_kind=mask_kind)  # fmt: skip
    B, H, T, D = 2, 2, 19, 16
    g = torch.Generator().manual_seed(bits)
    k = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype).to(DEVICE)
    v = torch.randn(B, H, T, D, generator=g).to(dtype).to(DEVICE)
    keep = torch.ones(B, H, T, dtype=torch.bool)
    tiers = hex_tiers(torch.rand(B, H, T, generator=g), keep, torch.zeros_like(keep), bits, 0.2, 1, 8)
    store = HEXStore(cfg)
    store.write(k, v, Plan(tiers.to(DEVICE)), torch.arange(T, device=DEVICE).expand(B, T))
    x = torch.randn(B, H, 6, D, generator=g).to(dtype).to(DEVICE)
    store.append(x, x, torch.arange(T, T + 6, device=DEVICE).expand(B, 6))  # 3 + 6 residual: one block compressed
    if ragged:
        bits_ = store.tiers().key_bits.clone()
        bits_[1, 1] = 0  # (b=1, h=1) holds nothing
        bits_[0, 0, 1::3] = 0
        store.retier(Plan(bits_))
    assert len(store._segments) == 2 and store.residual_lengths().sum() > 0
    return store


def legacy_decode(seg, cfg):
    """The reconstruction read() gave before the kernels (Segment.decode, element mask expanded densely)."""
    from kvcodec.packing import unpack_unchecked

    ids = seg.seg()
    slot = seg.slots(ids) if seg.coded else torch.zeros_like(ids)
    emask = seg.element_mask(cfg, ids, slot) if seg.coded else None
    out = []
    for kind in ("k", "v"):
        full = seg.full(kind)
        rows = torch.zeros(full.numel(), seg.D, dtype=getattr(seg, f"{kind}_rows").dtype, device=full.device)
        rows[full] = getattr(seg, f"{kind}_rows")
        coded = ~full
        if bool(coded.any()):
            codes = unpack_unchecked(getattr(seg, f"{kind}_codes"), cfg.bits, seg.D).float()
            if kind == "k":
                s, z = seg.k_scale.float()[ids[coded]], seg.k_zero.float()[ids[coded]]
            elif cfg.value_scope == "layer":
                b = ids[coded] // seg.H
                s, z = seg.v_scale.float()[b, slot[coded]][:, None], seg.v_zero.float()[b, slot[coded]][:, None]
            else:
                s, z = seg.v_scale.float()[:, None], seg.v_zero.float()[:, None]
            deq = (codes * s + z).to(rows.dtype)
            deq[emask[coded]] = getattr(seg, f"{kind}_over")
            rows[coded] = deq
        out.append(rows)
    return out


CASES = [
    (torch.float16, 3, "layer", "layer", "expander"),
    (torch.bfloat16, 4, "head", "head", "random"),
    (torch.float32, 3, "head", "layer", "none"),
]


@pytest.mark.parametrize(("dtype", "bits", "value_scope", "mask_scope", "mask_kind"), CASES)
def test_dequantize_kernel_equals_reference_and_the_previous_read(dtype, bits, value_scope, mask_scope, mask_kind):
    """Dequantize + overlay merge: Triton == PyTorch reference, bit for bit, on every part; on segments both equal
    the dense-mask reconstruction read() used before (codes, statistics, overlay values and full rows exercised)."""
    from kv_hex.kernels.reference import dequantize_part
    from kv_hex.kernels.triton_dequant import dequantize_part_triton

    store = hex_store(dtype, bits, value_scope, mask_scope, mask_kind)
    parts = store._layouts()
    assert parts[0].k.codes.shape[0] and parts[0].k.rows.shape[0] and parts[0].v.codes.shape[0]
    if mask_kind != "none":
        assert parts[0].hcols.shape[-1] > 0 and parts[0].k.over.numel() > 0 and parts[1].v.over.numel() > 0
    legacy = [legacy_decode(s, store.config) for s in store._segments] + [[store._res["k"], store._res["v"]]]
    for part, old in zip(parts, legacy):
        want = dequantize_part(part)
        got = dequantize_part_triton(part, block_t=16)
        for a, b, c in zip(got, want, old):
            assert a.dtype == b.dtype == dtype and torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize(("dtype", "bits", "value_scope", "mask_scope", "mask_kind"), CASES)
def test_decode_attention_kernel_equals_reference(dtype, bits, value_scope, mask_scope, mask_kind):
    """Fused decode attention over one part: out, lse and every entry's logits equal the reference (fp32
    tolerance); GQA (2 query heads per KV head, 2 queries), ragged heads with one empty head (out 0, lse -inf),
    heads split across programs (tiles of 16, one per program)."""
    from kv_hex.kernels.reference import part_attention
    from kv_hex.kernels.triton_attention import part_attention_triton

    parts = hex_store(dtype, bits, value_scope, mask_scope, mask_kind, ragged=True)._layouts()
    q = torch.randn(2, 4, 2, 16, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    for part in parts:
        assert int(part.count[3]) == 0
        want = part_attention(q, part, 0.25, logits=True)
        got = part_attention_triton(q, part, 0.25, logits=True, block_t=16, max_blocks=1)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert bool(torch.isinf(got[1][1, 2:]).all()) and bool((got[0][1, 2:] == 0).all())


def test_decode_attention_on_the_matrix_units_in_float16():
    """The cache-dtype path (float16 query and cache on tl.dot, probabilities split into two float16 parts) stays
    within float32-level error of the reference; one cast of p to float16 would be off by ~1e-3. A float32 query
    with tensor_cores=True is refused. (The bfloat16 twin runs on GPUs only: the interpreter's bfloat16 tl.dot is
    wrong.)"""
    from kv_hex.kernels.reference import part_attention
    from kv_hex.kernels.triton_attention import part_attention_triton

    parts = hex_store(torch.float16, 3, "head", "layer", "expander")._layouts()
    q = (torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(8)) * 3).to(torch.float16).to(DEVICE)
    for part in parts:
        want = part_attention(q, part, 0.25, logits=True)
        got = part_attention_triton(q, part, 0.25, logits=True, tensor_cores=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="tensor_cores"):
        part_attention_triton(q.float(), parts[0], 0.25, tensor_cores=True)


@pytest.mark.parametrize(("dtype", "bits", "value_scope", "mask_scope", "mask_kind"), CASES)
def test_values_share_the_keys_entry_maps_when_both_are_full_at_the_same_entries(
    dtype, bits, value_scope, mask_scope, mask_kind
):
    """HEX keeps whole tokens in full precision, so a segment's key and value flags are equal
    (``Segment.flags_shared``) and its layout builds the entry maps once: the values' ``idx`` and overlay offsets
    are the keys' own tensors, and equal what the values' flags give on their own (statistics rows equal wherever
    an entry is coded; a segment whose flags differ builds its own)."""
    import dataclasses

    from kv_hex.layout import _side, segment_layout
    from kv_hex.segment import full_flags

    store = hex_store(dtype, bits, value_scope, mask_scope, mask_kind)
    for seg in store._segments:
        assert seg.flags_shared
        lay = segment_layout(store.config, seg)
        assert lay.v.idx is lay.k.idx and lay.v.ooff is lay.k.ooff
        own = _side(seg, "v", store.config, seg.seg(), lay.slot.long(), lay.hcols)
        coded = own.idx >= 0
        assert torch.equal(lay.v.idx, own.idx) and torch.equal(lay.v.ooff, own.ooff)
        assert torch.equal(lay.v.grp[coded], own.grp[coded])
        assert bool((lay.v.grp >= 0).all())  # in range at full rows too (their statistics row is read)
    seg = store._segments[0]
    flags = seg.full("v").clone()
    flags[int((~flags).nonzero()[0])] = True  # one more full value than keys: the flags differ
    other = dataclasses.replace(seg, v_full=full_flags(flags))
    assert not other.flags_shared
    lay = segment_layout(store.config, other)
    assert lay.v.idx is not lay.k.idx and int((lay.v.idx < 0).sum()) == int((lay.k.idx < 0).sum()) + 1


# -- uniform segments addressed by arithmetic (kv_hex.uniform, kv_hex.kernels.triton_uniform) -----------------
@pytest.mark.parametrize(("dtype", "bits", "value_scope", "mask_scope", "mask_kind"), CASES)
def test_a_uniform_part_addresses_the_same_entries_as_the_general_layout(
    dtype, bits, value_scope, mask_scope, mask_kind
):
    """Every entry of the prompt's segment and of a decode block, read through the uniform part's two running counts
    (full rows, code rows, statistics rows, slots, overlay offsets), is bit for bit the entry the general layout
    reads (keys and values; codes, overlay values and full rows all present)."""
    store = hex_store(dtype, bits, value_scope, mask_scope, mask_kind)
    for seg in store._segments:
        part = uniform_part(store.config, seg)
        assert part is not None and part.num_entries == seg.num_entries
        full = seg.full("k")
        assert bool(full.any()) and bool((~full).any())
        assert torch.equal(part.before[0].long(), torch.cumsum(full.long(), 0) - full.long())
        want = reference.dequantize_part(segment_layout(store.config, seg))
        got = reference.dequantize_part(as_part_layout(part))
        for a, b in zip(got, want):
            assert a.dtype == dtype and torch.equal(a, b)


def test_segments_that_are_not_uniform_take_the_general_layout():
    """After an eviction a head misses slots: no uniform part (the store falls back to the general layout)."""
    store = hex_store(torch.float32, 3, "layer", "layer", "expander", ragged=True)
    assert uniform_part(store.config, store._segments[0]) is None


def _close(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for (gs, gr), (ws, wr) in zip(got[2], want[2]):
        for a, b in ((gs, ws), (gr, wr)):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "bits", "value_scope", "mask_scope", "mask_kind"), CASES)
@pytest.mark.parametrize("residual", [0, 5])
def test_uniform_kernel_equals_reference(dtype, bits, value_scope, mask_scope, mask_kind, residual):
    """The fused kernel over a uniform segment and the residual's rows: out, lse and both sets of logits equal the
    reference (float32 tolerance); GQA (2 query heads per KV head, 2 queries), the segment split over programs
    (tiles of 16, one a program), residual rows in tiles of 16 over two splits, or no residual rows at all; and the
    segment alone equals the general kernel's reference over its layout."""
    from kv_hex.kernels.triton_uniform import uniform_attention_triton
    from kv_hex.uniform import UniformCall

    store = hex_store(dtype, bits, value_scope, mask_scope, mask_kind)
    seg = store._segments[0]
    part = uniform_part(store.config, seg)
    S = part.B * part.H
    g = torch.Generator().manual_seed(11)
    rk = torch.randn(S, residual, 16, generator=g).to(dtype).to(DEVICE)
    rv = torch.randn(S, residual, 16, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(2, 4, 2, 16, generator=g).to(dtype).to(DEVICE)
    calls = [UniformCall(part, rk, rv, seg_logits=True, res_logits=True)]
    want = reference.uniform_attention(q, calls, 0.25)
    got = uniform_attention_triton(q, calls, 0.25, block_t=16, max_blocks=1, res_blocks=1)
    assert got[2][0][0].shape == (part.num_entries, 4) and got[2][0][1].shape == (S * residual, 4)
    _close(got, want)
    # without the residual's rows: the segment alone, as the general kernel attends it
    want = reference.part_attention(q, segment_layout(store.config, seg), 0.25, True)
    got = uniform_attention_triton(q, [UniformCall(part, seg_logits=True)], 0.25, block_t=16, max_blocks=2)
    for a, b in zip((got[0], got[1], got[2][0][0]), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[2][0][1] is None


@pytest.mark.parametrize(("dtype", "bits", "value_scope", "mask_scope", "mask_kind"), CASES)
def test_uniform_kernel_over_a_stack_and_a_segment_in_one_merge(dtype, bits, value_scope, mask_scope, mask_kind):
    """Two calls, one merge: a stack of three decode blocks (addressed in the kernel: block ``i`` of batch row ``b``
    is the stack's row ``i·B + b``; no repeated query) and the prompt's segment with residual rows, each launch
    writing its splits into one buffer of partial results; equal to the reference (each attended on its own, the
    stack with the query repeated per block, then merged), logits of every part in entry order."""
    from kv_hex.kernels.triton_uniform import uniform_attention_triton
    from kv_hex.segment import stack_segments
    from kv_hex.uniform import UniformCall

    store = hex_store(dtype, bits, value_scope, mask_scope, mask_kind)
    g = torch.Generator().manual_seed(5)
    B, H, D = store._shape
    for step in range(16):  # two more decode blocks of 8
        x = torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEVICE)
        store.append(x, -x, torch.full((B, 1), 25 + step, device=DEVICE))
    blocks = store._segments[1:]
    assert len(blocks) == 3
    stack = uniform_part(store.config, stack_segments(blocks))
    main = uniform_part(store.config, store._segments[0])
    rk = torch.randn(B * H, 3, D, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(B, 4, 2, D, generator=g).to(dtype).to(DEVICE)
    calls = [UniformCall(stack, stack=3, seg_logits=True), UniformCall(main, rk, -rk, seg_logits=True, res_logits=True)]
    want = reference.uniform_attention(q, calls, 0.25)
    got = uniform_attention_triton(q, calls, 0.25, block_t=16, max_blocks=1, res_blocks=1)
    _close(got, want)
    with pytest.raises(ValueError, match="needs 2 rows and 2 heads, got 6"):
        uniform_attention_triton(q, [UniformCall(stack, stack=1)], 0.25)
    if dtype != torch.float32:
        other = dataclasses.replace(main, k_rows=main.k_rows.float())
        with pytest.raises(ValueError, match="share one cache dtype"):
            uniform_attention_triton(q, [calls[0], UniformCall(other)], 0.25)


def test_the_store_keeps_uniform_segments_after_appends_and_loses_them_after_an_eviction():
    """HEX's own writes and appends leave every segment uniform; a plan that evicts makes the touched one ragged."""
    store = hex_store(torch.float32, 3, "layer", "layer", "expander")
    assert all(uniform_part(store.config, s) is not None for s in store._segments)
    bits = store.tiers().key_bits.clone()
    bits[0, 0, 2] = 0
    store.retier(Plan(bits))
    assert uniform_part(store.config, store._segments[0]) is None


@pytest.mark.parametrize("with_acc", [False, True])
def test_the_accumulator_kernel_equals_its_reference(with_acc):
    """The heavy-hitter accumulator after a step in one launch: the attention probabilities summed over each head's
    query rows, added to the held accumulator; entries a row did not see (``-inf`` logits) and rows that saw nothing
    (``-inf`` log-sum-exp) add 0, never NaN. Several programs per head (tiles of 8 over 21 entries)."""
    pytest.importorskip("triton")
    from kv_hex.kernels.reference import accumulate_attention
    from kv_hex.kernels.triton_accumulate import accumulate_attention_triton

    g = torch.Generator().manual_seed(4)
    S, T, R = 3, 21, 5
    logits = torch.randn(S, T, R, generator=g)
    logits[0, 3:7] = float("-inf")
    lse = torch.logsumexp(logits, 1) + torch.rand(S, R, generator=g)  # other parts of the cache add mass
    lse[2, 1] = float("-inf")
    logits[2, :, 1] = float("-inf")  # a row that saw nothing
    acc = torch.rand(S * T, generator=g) if with_acc else None
    want = accumulate_attention(acc, logits, lse)
    got = accumulate_attention_triton(acc, logits, lse, block_t=8)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    base = acc if acc is not None else torch.zeros(S * T)
    assert bool((got >= base - 1e-6).all()) and torch.equal(got.view(S, T)[0, 3:7], base.view(S, T)[0, 3:7])
