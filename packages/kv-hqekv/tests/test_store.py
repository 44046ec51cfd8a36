"""The HqeKV store: the decode-time properties (bits never increase, evicted never returns); its conformance suite is
in test_conformance.py."""

import pytest
import torch

from kv_hqekv import HqeKVStore


def test_fused_attention_over_every_tier_pair():
    """attend() = softmax(q·K̂ᵀ/√d)·V̂ over the dequantized view, with every (key tier, value tier) pair present,
    values evicted under kept keys (V = 0), GQA and fp16 data."""
    from kvcore import EVICT, Plan, reference_attention

    g = torch.Generator().manual_seed(0)
    B, H, T, D, G = 2, 2, 96, 32, 8
    tiers = torch.tensor([16, 4, 2, 1], dtype=torch.uint8)
    kb = tiers[torch.randint(4, (B, H, T // G), generator=g)].repeat_interleave(G, -1)
    vb = torch.cat([tiers, torch.tensor([EVICT], dtype=torch.uint8)])[torch.randint(5, (B, H, T // G), generator=g)]
    vb = vb.repeat_interleave(G, -1)
    kb[..., :G] = EVICT
    for dtype, one_bit in ((torch.float32, "normalized"), (torch.float16, "normalized"), (torch.float32, "uniform")):
        store = HqeKVStore(block=G, one_bit=one_bit)
        k, v = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
        store.write(k, v, Plan(kb, vb), torch.arange(T).expand(B, T))
        q = torch.randn(B, 2 * H, 1, D, generator=g).to(dtype)
        out, lse = store.attend(q)
        ref_out, ref_lse = reference_attention(store.read(), q)
        assert torch.allclose(out, ref_out, atol=2e-3, rtol=1e-3) and torch.allclose(lse, ref_lse, atol=1e-3)
        view = store.read()
        evicted_v = (vb != EVICT) | (kb == EVICT)
        assert view.keys.shape[2] == T - G and bool((view.values[~evicted_v[..., G:]] == 0).all())


def _packed_bytes(store, D: int, G: int) -> int:
    """Theoretical packed size from the tier counts: codes, one (scale, zero) pair per group in the cache dtype
    (a ``[D]`` row per key group of ``G`` tokens, ``ceil(D / G)`` per value token) and the fp16-tier rows."""
    c = store.tier_counts()
    el = torch.finfo(store._dtype).bits // 8
    total = 0
    for side in ("keys", "values"):
        total += int(c[f"{side}_16"].sum()) * D * el
        for b in (4, 2, 1):
            n = int(c[f"{side}_{b}"].sum())
            groups = -(-n // G) * D if side == "keys" else n * -(-D // G)
            total += (n * D * b + 7) // 8 + 2 * groups * el
    return total


@pytest.mark.parametrize(
    ("H", "Hq", "D", "dtype"),
    [(8, 32, 128, torch.float32), (3, 9, 64, torch.float16)],
    ids=["llama8b-fp32", "smollm-fp16"],
)
def test_held_bytes_within_1_percent_of_the_packed_size(H, Hq, D, dtype):
    """One layer at the paper's Llama-8B shape in float32 and at SmolLM2's (3 KV heads, d = 64) in float16, 2-bit
    shares, 1k tokens, then 24 decode appends: the metadata -- quantized rows' positions as runs of consecutive
    positions, run-length segment ids, int16 counts, the fp16 rows' int16 positions -- adds under 1% to the packed
    payload (one int16 position per quantized row, as before the runs, cost 4-8% at d = 64 in fp16); the metadata
    is still held (the bound is not met by leaving it out)."""
    from kv_hqekv import HqeKVConfig, hqekv
    from kvcore import ScoringContext

    B, T = 1, 1024
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
    q = torch.randn(B, Hq, 20, D, generator=g).to(dtype)
    store = hqekv(2.0, config=HqeKVConfig()).compress(ScoringContext(keys=k, values=v, queries=q))
    for step in range(24):
        new = [torch.randn(B, H, 1, D, generator=g).to(dtype) for _ in range(2)]
        store.append(*new, torch.tensor([[T + step]]))
        assert _packed_bytes(store, D, 32) < store.nbytes() <= 1.01 * _packed_bytes(store, D, 32)


def test_positions_widen_past_int16_and_stay_exact():
    """Positions are stored in int16 while they fit; an entry beyond 32,767 widens them for good, and reads,
    crops and attention see the true positions either side of the boundary."""
    from kvcore import Plan, reference_attention

    B, H, T, D, G = 1, 2, 16, 8, 4
    g = torch.Generator().manual_seed(0)
    store = HqeKVStore(block=G)
    start = 32_760
    bits = torch.tensor([16, 4, 2, 1], dtype=torch.uint8).repeat_interleave(G)[None, None].expand(B, H, T)
    pos = torch.arange(start - T, start)[None]
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    store.write(k, v, Plan(bits.contiguous()), pos)
    assert store.read().positions[0, 0].tolist() == pos[0].tolist()
    appended = []
    for step in range(12):  # crosses 32,767
        p = start + step
        store.append(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g), torch.tensor([[p]]))
        appended.append(p)
    view = store.read()
    assert view.positions[0, 0].tolist() == pos[0].tolist() + appended
    assert store._parts["k"][0].pos.dtype == torch.int32  # widened (the residual holds the appended tokens)
    q = torch.randn(B, 4, 1, D, generator=g)
    torch.testing.assert_close(store.attend(q)[0], reference_attention(view, q)[0], rtol=1e-4, atol=1e-4)
    store.crop(32_768)  # keeps positions < 32,768: a Python int beyond int16 compared correctly
    assert store.read().positions[0, 0].tolist() == pos[0].tolist() + [p for p in appended if p < 32_768]
