"""Decode attention v2 over HqeKV's mixed tiers (the folded formulation, issue 43): the Triton kernel (interpreter on
CPU: small shapes, few large program blocks; compiled on a GPU) and its PyTorch reference agree with attention over
the store's dequantized entries within docs/protocols.md's tolerance contract (kvcodec.decode_v2.OUT_RTOL /
LSE_ATOL), over every tier on each side (fp16, 4, 2, normalized 1 bit, evicted values), ragged heads, the fp16
tail advanced by appends, any split of the blocks over programs; at Gemma 3's (d 256, 1 KV head) and SmolLM2's
(d 64, 3 KV heads) head shapes."""

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from kv_hqekv import HqeKVStore
from kv_hqekv.kernels.folded import blocked_decode_v2, blocked_decode_v2_ref, contract_errors
from kvcodec.decode_v2 import LSE_ATOL, OUT_RTOL, within_tolerance
from kvcore import EVICT, FULL, Plan, reference_attention

triton = pytest.importorskip("triton")

from kv_hqekv.kernels.triton_folded import blocked_decode_v2_triton, supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIERS = torch.tensor([FULL, 4, 2, 1], dtype=torch.uint8)


def make_store(seed, B, H, blocks, tail, G, D, before, after, dtype, evict=True):
    """A store of ``blocks`` whole blocks (random key and value tiers per block, values possibly evicted, one head's
    first block evicted where ``evict``) and ``tail`` fp16 rows per head, its block layout taken after ``before``
    decode tokens and advanced through ``after`` more. Keys carry per-channel offsets (KIVI's motivation)."""
    g = torch.Generator().manual_seed(seed)
    T = blocks * G + tail
    vtiers = torch.cat([TIERS, torch.tensor([EVICT], dtype=torch.uint8)])
    kb = TIERS[torch.randint(4, (B, H, blocks), generator=g)].repeat_interleave(G, -1)
    vb = vtiers[torch.randint(5, (B, H, blocks), generator=g)].repeat_interleave(G, -1)
    if evict and blocks > 1:
        kb[0, 0, :G] = EVICT  # a ragged head
    full = torch.full((B, H, tail), FULL, dtype=torch.uint8)
    plan = Plan(torch.cat([kb, full], -1).contiguous().to(DEVICE), torch.cat([vb, full], -1).contiguous().to(DEVICE))
    k = torch.randn(B, H, T, D, generator=g) * 2 + torch.randn(B, H, 1, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g)
    store = HqeKVStore(block=G)
    store.write(k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), plan, torch.arange(T).expand(B, T).to(DEVICE))
    for i in range(before + after):
        if i == before:
            assert store.decode_layout() is not None
        kv = torch.randn(2, B, H, 1, D, generator=g).to(dtype).to(DEVICE)
        store.append(kv[0], kv[1], torch.full((B, 1), T + i).to(DEVICE))
    return store, g


def check(out, lse, q, blocked, scale):
    """The contract: within OUT_RTOL / LSE_ATOL of attention over the float32 dequantization, within that plus twice
    read()'s own rounding error of attention over read()'s entries."""
    e = contract_errors(out, lse, q, *blocked, scale)
    assert e["out_f32"] <= OUT_RTOL and e["lse_f32"] <= LSE_ATOL, e
    assert e["out_ratio"] <= 1 and e["lse_ratio"] <= 1, e
    return e


@settings(
    max_examples=10, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    blocks=st.integers(0, 4),
    tail=st.integers(0, 5),
    steps=st.sampled_from([(0, 0), (0, 3), (2, 1)]),
    group=st.sampled_from([1, 2, 4]),
    tiles=st.sampled_from([1, 2, None]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_kernel_and_reference_within_the_contract(seed, B, H, blocks, tail, steps, group, tiles, dtype):
    """The tolerance contract holds for the kernel and its reference over any mix of tiers, ragged heads and any
    split of the blocks over programs; the two agree within half the tolerance."""
    assume(blocks + tail + sum(steps) > 0)
    store, g = make_store(seed, B, H, blocks, tail, 16, 64, *steps, dtype)
    blocked = store.decode_layout()
    q = (torch.randn(B, H * group, 1, 64, generator=g) * (1 + seed % 3)).to(dtype).to(DEVICE)
    out, lse = blocked_decode_v2_triton(q, *blocked, 0.125, tiles=tiles)
    check(out, lse, q, blocked, 0.125)
    r_out, r_lse = blocked_decode_v2_ref(q, *blocked, 0.125)
    check(r_out, r_lse, q, blocked, 0.125)
    rel, dl = within_tolerance(out, lse.unsqueeze(-1), r_out, r_lse.unsqueeze(-1))
    assert rel <= OUT_RTOL / 2 and dl <= LSE_ATOL / 2


@pytest.mark.parametrize(
    ("name", "H", "group", "D", "dtype"),
    [("gemma3", 1, 4, 256, torch.bfloat16), ("smollm2", 3, 3, 64, torch.float16)],
)
def test_model_shapes(name, H, group, D, dtype):
    """Gemma 3 (head dim 256, one KV head, 4 query heads) and SmolLM2 (head dim 64, 3 KV heads, GQA group 3) at
    HqeKV's block of 32: every tier on both sides, a tail advanced by appends; two query rows per head."""
    store, g = make_store(7, 1, H, 4, 5, 32, D, 1, 2, dtype)
    blocked = store.decode_layout()
    q = torch.randn(1, H * group, 2, D, generator=g).to(dtype).to(DEVICE)
    scale = D**-0.5
    out, lse = blocked_decode_v2_triton(q, *blocked, scale, tiles=2)
    check(out, lse, q, blocked, scale)
    check(*blocked_decode_v2_ref(q, *blocked, scale), q, blocked, scale)


def test_reference_over_a_float32_store_agrees_with_attention_over_read():
    """Nothing rounded to the cache dtype: the reference is attention over read() up to its float16 operand
    roundings (the contract's OUT_RTOL / LSE_ATOL, no allowance needed)."""
    store, g = make_store(3, 2, 2, 4, 3, 16, 64, 1, 1, torch.float32)
    blocked = store.decode_layout()
    q = torch.randn(2, 4, 1, 64, generator=g).to(DEVICE)
    out, lse = blocked_decode_v2_ref(q, *blocked, 0.125)
    ref_out, ref_lse = reference_attention(store.read(), q, 0.125)
    rel, dl = within_tolerance(out.flatten(0, 2), lse.reshape(-1, 1), ref_out.flatten(0, 2), ref_lse.reshape(-1, 1))
    assert rel <= OUT_RTOL and dl <= LSE_ATOL


def test_dispatch_and_store_decode_path(monkeypatch):
    """The dispatcher takes the reference off CUDA and for caches the kernel does not take (float32, G < 16);
    ``attend`` keeps its exact path unless folded decoding is asked for (on CUDA only)."""
    from kv_hqekv import attention

    store, g = make_store(5, 1, 2, 3, 2, 16, 64, 0, 1, torch.float32)
    blocked = store.decode_layout()
    q = torch.randn(1, 4, 1, 64, generator=g).to(DEVICE)
    assert not supported(q, *blocked)
    for a, b in zip(blocked_decode_v2(q, *blocked, 0.125), blocked_decode_v2_ref(q, *blocked, 0.125)):
        torch.testing.assert_close(a, b)
    monkeypatch.setattr(attention, "FOLDED_DECODE", True)
    out, lse = store.attend(q, 0.125)
    ref_out, ref_lse = reference_attention(store.read(), q, 0.125)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)  # CPU or float32: the exact path, whatever the flag
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
