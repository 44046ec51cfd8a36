"""Decode attention v2 (the folded formulation over KIVI's packed decode layout, issue 43) and its tolerance contract
(docs/protocols.md): the Triton kernel (interpreter on CPU: small shapes, few large blocks; compiled on a GPU) and its
PyTorch reference agree with attention over the dequantized cache within OUT_RTOL / LSE_ATOL, over every part of the
layout (quantized keys and values, key residual, value ring before and after it turns), any split of the entries
over programs; the code conversion's plain-Triton twin gives 1024 + 2^(bits*lane) * code exactly."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvcodec.decode_v2 import (
    LSE_ATOL,
    OUT_RTOL,
    PackedKIVI,
    contract_errors,
    kivi_decode_v2,
    kivi_decode_v2_ref,
    within_tolerance,
)

triton = pytest.importorskip("triton")
import triton.language as tl

from kvcodec.kernels.triton_decode_v2 import code_halves, kivi_decode_v2_triton, supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _quantize(x: torch.Tensor, bits: int, dim: int):
    """Min-max codes of ``x`` over ``dim`` (as kvcodec's UniformQuantizer: zero = min, scale = range / levels)."""
    mn, mx = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((mx - mn) / ((1 << bits) - 1)).clamp_min(1e-8)
    codes = ((x - mn) / scale).round().clamp(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale, mn


def _pack_inner(codes: torch.Tensor, bits: int, cap: int) -> torch.Tensor:
    """uint8 ``[S, P, cap]`` token-inner bytes of codes ``[S, n, D]`` (little-endian lanes)."""
    S, n, D = codes.shape
    L = 8 // bits
    c = codes.view(S, n, D // L, L).to(torch.int32)
    byte = (c << (torch.arange(L, dtype=torch.int32) * bits)).sum(-1).to(torch.uint8)  # [S, n, P]
    out = torch.zeros(S, D // L, cap, dtype=torch.uint8)
    out[:, :, :n] = byte.transpose(1, 2)
    return out


def make_cache(seed, S, D, kbits, vbits, G, GV, groups, nr, nv, head, dtype, spare=16):
    """A random :class:`PackedKIVI` of ``groups * G + nr`` entries per head: ``groups`` key groups and ``nr`` residual
    key rows; the last ``nv`` values in a ring turned by ``head``. Buffers carry ``spare`` unused slots, as the
    decode layout's reserve does."""
    gen = torch.Generator().manual_seed(seed)
    tk = groups * G
    T = tk + nr
    tv = T - nv
    k = torch.randn(S, T, D, generator=gen) * 2 + torch.randn(S, 1, D, generator=gen)  # per-channel offsets
    v = torch.randn(S, T, D, generator=gen)
    kcodes, ksc, kzr = _quantize(k[:, :tk].reshape(S, groups, G, D), kbits, 2)  # [S, nG, G, D], [S, nG, 1, D]
    kc = _pack_inner(kcodes.view(S, tk, D), kbits, tk + spare)
    ks = torch.zeros(S, D, groups + 2, dtype=dtype)
    kz = torch.zeros(S, D, groups + 2, dtype=dtype)
    ks[:, :, :groups] = ksc[:, :, 0].transpose(1, 2).to(dtype)
    kz[:, :, :groups] = kzr[:, :, 0].transpose(1, 2).to(dtype)
    C = D // GV
    vcodes, vsc, vzr = _quantize(v[:, :tv].reshape(S, tv, C, GV), vbits, 3)  # scales [S, tv, C, 1]
    vc = _pack_inner(vcodes.view(S, tv, D), vbits, tv + spare)
    vs = torch.zeros(S, C, tv + spare, dtype=dtype)
    vz = torch.zeros(S, C, tv + spare, dtype=dtype)
    vs[:, :, :tv] = vsc[..., 0].transpose(1, 2).to(dtype)
    vz[:, :, :tv] = vzr[..., 0].transpose(1, 2).to(dtype)
    kr = torch.zeros(S, nr + 3, D, dtype=dtype)
    kr[:, :nr] = k[:, tk:].to(dtype)
    ring = torch.zeros(S, max(nv, 1) + 2, D, dtype=dtype)
    ring[:, :nv] = v[:, tv:].to(dtype).roll(head, 1)  # entry tv + i in slot (i + head) mod nv
    t = {k_: x.to(DEVICE) for k_, x in dict(kc=kc, ks=ks, kz=kz, kr=kr, vc=vc, vs=vs, vz=vz, ring=ring).items()}
    cache = PackedKIVI(**t, tk=tk, nr=nr, tv=tv, nv=nv, head=head % max(nv, 1), kbits=kbits, vbits=vbits, group=G,
                       vgroup=GV)  # fmt: skip
    return cache, gen


def check_contract(out, lse, q, cache, scale):
    """docs/protocols.md: within OUT_RTOL / LSE_ATOL of attention over the codes dequantized in float32, and within
    that plus twice read()'s own rounding error of attention over read()'s entries."""
    e = contract_errors(out, lse, q, cache, scale)
    assert e["out_f32"] <= OUT_RTOL and e["lse_f32"] <= LSE_ATOL, e
    assert e["out_ratio"] <= 1 and e["lse_ratio"] <= 1, e
    return e


@settings(max_examples=16, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking
@given(
    seed=st.integers(0, 10_000),
    bits=st.sampled_from([(2, 2), (4, 4), (4, 2), (8, 8)]),
    parts=st.sampled_from([(3, 5, 16), (2, 0, 7), (4, 13, 1), (2, 16, 16)]),
    M=st.sampled_from([1, 2, 4]),
    head=st.integers(0, 5),
    split=st.sampled_from([(16, 1), (16, 2), (None, None)]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_kernel_within_the_contract_of_attention_over_the_dequantized_cache(seed, bits, parts, M, head, split, dtype):
    """The tolerance contract (docs/protocols.md, check_contract) holds for the kernel and its reference, whichever
    split of the entries over programs; the two agree within half the tolerance."""
    groups, nr, nv = parts
    cache, gen = make_cache(seed, 2, 64, *bits, 16, 16, groups, nr, nv, head, dtype)
    q = (torch.randn(2, M, 64, generator=gen) * (1 + seed % 4)).to(DEVICE, dtype)  # logits up to ~4x unit scale
    block_t, tiles = split
    out, lse = kivi_decode_v2_triton(q, cache, 0.2, block_t=block_t, tiles=tiles)
    check_contract(out, lse, q, cache, 0.2)
    r_out, r_lse = kivi_decode_v2_ref(q, cache, 0.2)
    check_contract(r_out, r_lse, q, cache, 0.2)
    rel, lse_err = within_tolerance(out, lse, r_out, r_lse)
    assert rel <= OUT_RTOL / 2 and lse_err <= LSE_ATOL / 2


@pytest.mark.parametrize(
    ("bits", "dtype"), [((2, 2), torch.float16), ((4, 4), torch.bfloat16), ((4, 2), torch.float16)]
)
def test_contract_at_fixed_cases(bits, dtype):
    """The contract at a few fixed shapes (the property test's, without hypothesis: what the GPU run checks)."""
    cache, gen = make_cache(3, 2, 64, *bits, 16, 16, 3, 5, 16, 2, dtype)
    q = (torch.randn(2, 4, 64, generator=gen) * 3).to(DEVICE, dtype)
    check_contract(*kivi_decode_v2_triton(q, cache, 0.2, block_t=16, tiles=2), q, cache, 0.2)


@pytest.mark.parametrize("asm", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_code_conversion_is_exact(bits, asm):
    """Every lane of every byte becomes its code as float16 exactly (1024.0's mantissa OR-ed with the lane's bits in
    place, then one multiply-add): the plain-Triton twin, and on a GPU the inline PTX (the interpreter cannot run
    PTX)."""
    if asm and DEVICE.type != "cuda":
        pytest.skip("inline PTX needs a GPU")
    L = 8 // bits

    @triton.jit
    def kernel(b_ptr, o_ptr, BITS: tl.constexpr, ASM: tl.constexpr):
        i = tl.arange(0, 256)
        halves = code_halves(tl.load(b_ptr + i), BITS, ASM)
        for j in tl.static_range(8 // BITS):
            tl.store(o_ptr + j * 256 + i, halves[j])

    b = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(L, 256, dtype=torch.float16, device=DEVICE)
    kernel[(1,)](b, out, BITS=bits, ASM=asm)
    lane = torch.arange(L, device=DEVICE)[:, None]
    code = (b.long()[None, :] >> (bits * lane)) & ((1 << bits) - 1)
    assert torch.equal(out.double(), code.double())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="inline PTX needs a GPU")
@pytest.mark.parametrize("bits", [(2, 2), (4, 4), (8, 8)])
def test_inline_ptx_and_its_twin_give_the_same_attention(bits):
    # the same arithmetic: identical float16 operands, so identical products
    cache, gen = make_cache(9, 2, 128, *bits, 32, 32, 6, 7, 20, 3, torch.float16)
    q = torch.randn(2, 4, 128, generator=gen).to(DEVICE, torch.float16)
    a = kivi_decode_v2_triton(q, cache, 0.1, asm=True)
    b = kivi_decode_v2_triton(q, cache, 0.1, asm=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("steps", [0, 3, 9])
def test_the_value_ring_is_read_in_ring_order(steps):
    # a planted value in the ring slot of the newest entry, with a key that takes all the attention
    cache, _ = make_cache(5, 1, 32, 4, 4, 16, 8, 2, 6, 8, steps, torch.float16)
    newest = (cache.head + cache.nv - 1) % cache.nv
    cache.kr[:, cache.nr - 1] = 0.0
    cache.kr[:, cache.nr - 1, 0] = 30.0
    cache.ring[:, newest] = 100.0
    q = torch.zeros(1, 2, 32, device=DEVICE, dtype=torch.float16)
    q[..., 0] = 1.0
    out, lse = kivi_decode_v2_triton(q, cache, 1.0, block_t=16, tiles=1)
    assert torch.allclose(out, torch.full_like(out, 100.0), rtol=1e-3)
    check_contract(out, lse, q, cache, 1.0)


def test_long_cache_through_the_folded_path_and_splits():
    # 2-bit, D 64, GQA group 4 (the 16 matrix rows filled by 4 channel groups x 4 query heads), many splits
    cache, gen = make_cache(11, 2, 64, 2, 2, 32, 16, 12, 20, 32, 7, torch.float16)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE, torch.float16)
    for block_t, tiles in ((32, 1), (16, 4), (None, None)):
        check_contract(*kivi_decode_v2_triton(q, cache, 0.125, block_t=block_t, tiles=tiles), q, cache, 0.125)
    check_contract(*kivi_decode_v2(q, cache, 0.125), q, cache, 0.125)


def test_an_empty_query_and_unsupported_caches():
    cache, _ = make_cache(0, 1, 64, 2, 2, 16, 16, 1, 2, 2, 0, torch.float16)
    out, lse = kivi_decode_v2_triton(torch.zeros(1, 0, 64, device=DEVICE, dtype=torch.float16), cache, 1.0)
    assert out.shape == (1, 0, 64) and lse.shape == (1, 0, 1)
    small, gen = make_cache(0, 1, 32, 2, 2, 8, 8, 2, 3, 3, 0, torch.float16)  # key group 8 < 16, 8 code bytes
    assert not supported(small)
    with pytest.raises(ValueError, match="key group"):
        kivi_decode_v2_triton(torch.zeros(1, 1, 32, device=DEVICE, dtype=torch.float16), small, 1.0)
    q = torch.randn(1, 2, 32, generator=gen).to(DEVICE, torch.float16)
    check_contract(*kivi_decode_v2(q, small, 0.3), q, small, 0.3)  # the reference takes it
