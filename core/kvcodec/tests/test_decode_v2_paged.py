"""Decode attention v2 over a paged KIVI cache (vLLM's block pool + block table, issue 43): the layout's checks, the
PyTorch reference against the contiguous reference, invariance under the pool's block order, and the Triton kernel
(interpreter on CPU: small shapes, few large blocks; compiled on a GPU) within docs/protocols.md's tolerance contract.

Caches are quantized with kvcodec's UniformQuantizer as kv_vllm.packed packs a vLLM block: keys per channel over
groups of G tokens (G dividing the block size N), values per token in groups of GV channels; the open block stays at
full precision. Unused pool blocks and table entries hold garbage, so a kernel reading them fails the comparison."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvcodec.decode_v2 import (
    LSE_ATOL,
    OUT_RTOL,
    PackedKIVI,
    PagedPackedKIVI,
    kivi_decode_v2_paged,
    kivi_decode_v2_ref,
    paged_contract_errors,
    paged_decode_reference,
    within_tolerance,
)
from kvcodec.uniform import UniformQuantizer

triton = pytest.importorskip("triton")

import kvcodec.decode_v2 as decode_v2
import kvcodec.kernels.triton_decode_v2_paged as kernel_module
from kvcodec.kernels.triton_decode_v2_paged import paged_decode_v2_triton, supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sequences(seed, H, D, N, blocks, tails, dtype):
    """Random dense keys and values ``[H, n_b * N + tail_b, D]`` per sequence (keys with per-channel offsets)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n, nt in zip(blocks, tails, strict=True):
        T = n * N + nt
        k = torch.randn(H, T, D, generator=gen) * 2 + torch.randn(H, 1, D, generator=gen)
        seqs.append((k.to(dtype), torch.randn(H, T, D, generator=gen).to(dtype)))
    return seqs, gen


def _quantized(k, v, n, N, kbits, vbits, G, GV):
    """Token-inner codes and parameters of the first ``n * N`` entries, quantized as kv_vllm.packed does (a key group
    never crosses a block: G divides N). Keys ``kc [H, P, T]``, ``ks/kz [H, D, T / G]``; values ``vc [H, P, T]``,
    ``vs/vz [H, D / GV, T]``."""
    T = n * N
    if T == 0:
        H, _, D = k.shape
        codes = (
            torch.zeros(H, D * kbits // 8, 0, dtype=torch.uint8),
            torch.zeros(H, D * vbits // 8, 0, dtype=torch.uint8),
        )
        par = torch.zeros(H, D, 0, dtype=k.dtype), torch.zeros(H, D // GV, 0, dtype=k.dtype)
        return dict(kc=codes[0], ks=par[0], kz=par[0], vc=codes[1], vs=par[1], vz=par[1])
    kq = UniformQuantizer(kbits, "channel", G).quantize(k[:, :T])
    vq = UniformQuantizer(vbits, "token", GV).quantize(v[:, :T])
    return dict(
        kc=kq.codes.transpose(1, 2).contiguous(), ks=kq.scales.transpose(1, 2).contiguous(),
        kz=kq.zeros.transpose(1, 2).contiguous(), vc=vq.codes.transpose(1, 2).contiguous(),
        vs=vq.scales.transpose(1, 2).contiguous(), vz=vq.zeros.transpose(1, 2).contiguous(),
    )  # fmt: skip


def make_paged(seed, H, D, N, blocks, tails, bits=(4, 4), G=None, GV=16, dtype=torch.float16, order=None, spare=2,
               R=None, width=None):  # fmt: skip
    """``(PagedPackedKIVI, contiguous PackedKIVI per sequence, generator)``: sequences of ``blocks[b]`` packed blocks
    and ``tails[b]`` open entries. Logical block ``i`` of sequence ``b`` (the ``k``-th block overall) is stored at
    pool block ``order[k]`` (default: identity); ``spare`` extra pool blocks and every unused table entry hold
    garbage. The contiguous caches are built from the same codes, independently of the paged gather."""
    G = N if G is None else G
    kbits, vbits = bits
    seqs, gen = _sequences(seed, H, D, N, blocks, tails, dtype)
    total = sum(blocks)
    nb = total + spare
    order = list(range(total)) if order is None else list(order)
    B, R = len(blocks), (N if R is None else R)
    width = max(max(blocks), 1) + 1 if width is None else width
    garbage = torch.Generator().manual_seed(seed + 1)
    pool = dict(
        kc=torch.randint(0, 256, (nb, H, D * kbits // 8, N), generator=garbage, dtype=torch.uint8),
        vc=torch.randint(0, 256, (nb, H, D * vbits // 8, N), generator=garbage, dtype=torch.uint8),
    )
    for name, c in (("ks", D), ("kz", D), ("vs", D // GV), ("vz", D // GV)):
        pool[name] = (torch.rand(nb, H, c, N // G if name[0] == "k" else N, generator=garbage) * 50).to(dtype)
    table = torch.full((B, width), nb - 1, dtype=torch.int32)  # unused entries: a garbage block (or the last one)
    tail_k = torch.randn(B, H, R, D, generator=garbage).to(dtype) * 30  # garbage past each tail
    tail_v = torch.randn(B, H, R, D, generator=garbage).to(dtype) * 30
    contiguous, at = [], 0
    for b, ((k, v), n, nt) in enumerate(zip(seqs, blocks, tails, strict=True)):
        q = _quantized(k, v, n, N, kbits, vbits, G, GV)
        for i in range(n):
            pid = order[at + i]
            table[b, i] = pid
            for name, x in q.items():
                per = x.shape[-1] // n  # tokens or key groups per block
                pool[name][pid] = x[..., i * per : (i + 1) * per]
        at += n
        tail_k[b, :, :nt] = k[:, n * N :]
        tail_v[b, :, :nt] = v[:, n * N :]
        contiguous.append((b, {name: x.to(DEVICE) for name, x in q.items()}, n * N, nt))
    lens = torch.tensor([n * N + nt for n, nt in zip(blocks, tails, strict=True)], dtype=torch.int32)
    tail_k, tail_v = tail_k.to(DEVICE), tail_v.to(DEVICE)
    contiguous = [  # the open block's rows as the key residual and the value ring, in the same storage
        PackedKIVI(**fields, kr=tail_k[b], ring=tail_v[b], tk=tk, nr=nt, tv=tk, nv=nt, head=0, kbits=kbits,
                   vbits=vbits, group=G, vgroup=GV)
        for b, fields, tk, nt in contiguous
    ]  # fmt: skip
    cache = PagedPackedKIVI(
        **{name: x.to(DEVICE) for name, x in pool.items()}, tail_k=tail_k, tail_v=tail_v,
        block_table=table.to(DEVICE), seq_lens=lens.to(DEVICE), tail_lens=torch.tensor(tails, dtype=torch.int32),
        kbits=kbits, vbits=vbits, group=G, vgroup=GV,
    )  # fmt: skip
    return cache, contiguous, gen


def _query(gen, B, H, M, D, dtype, amp=2.0):
    return (torch.randn(B, H * M, D, generator=gen) * amp).to(DEVICE, dtype)


def check_contract(out, lse, q, cache, scale):
    """docs/protocols.md, per sequence: within OUT_RTOL / LSE_ATOL of attention over the codes dequantized in float32,
    and within the allowance of attention over read()'s entries."""
    e = paged_contract_errors(out, lse, q, cache, scale)
    assert e["out_f32"] <= OUT_RTOL and e["lse_f32"] <= LSE_ATOL, e
    assert e["out_ratio"] <= 1 and e["lse_ratio"] <= 1, e
    return e


@pytest.mark.parametrize("M", [1, 4])
def test_identity_table_reference_equals_the_contiguous_reference(M):
    """Block i of sequence b at pool block (its running index), the open block as the residual: the paged reference
    equals the contiguous reference over the same codes, quantized over the whole sequence (not gathered)."""
    cache, contiguous, gen = make_paged(0, 2, 64, 16, [3, 0, 2], [5, 7, 16], bits=(2, 4))
    q = _query(gen, 3, 2, M, 64, torch.float16)
    out, lse = paged_decode_reference(q, cache, 0.2)
    for b, c in enumerate(contiguous):
        o, s = kivi_decode_v2_ref(q[b].view(2, M, 64), c, 0.2)
        assert torch.equal(out[b], o.reshape(2 * M, 64)) and torch.equal(lse[b], s.reshape(2 * M, 1))


def test_an_empty_sequence_attends_to_nothing():
    cache, _, gen = make_paged(1, 2, 64, 16, [2, 0], [3, 0])
    q = _query(gen, 2, 2, 2, 64, torch.float16)
    for out, lse in (paged_decode_reference(q, cache, 0.3), paged_decode_v2_triton(q, cache, 0.3)):
        assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())
        assert bool(torch.isfinite(lse[0]).all())


@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking
@given(seed=st.integers(0, 10_000), perm_seed=st.integers(0, 10_000), bits=st.sampled_from([(2, 2), (4, 2)]))
def test_the_output_does_not_depend_on_where_the_blocks_lie_in_the_pool(seed, perm_seed, bits):
    """Invariant: permuting the pool's physical blocks, with the block table rewritten to follow them, leaves the
    output of the reference and of the kernel unchanged bit for bit (each reads logical block i through the table,
    and nothing else of the pool)."""
    blocks, tails = [3, 2], [4, 16]
    ident, _, gen = make_paged(seed, 2, 64, 16, blocks, tails, bits=bits)
    order = torch.randperm(sum(blocks) + 2, generator=torch.Generator().manual_seed(perm_seed))[: sum(blocks)]
    shuffled, _, _ = make_paged(seed, 2, 64, 16, blocks, tails, bits=bits, order=order.tolist())
    q = _query(gen, 2, 2, 2, 64, torch.float16)
    for fn in (paged_decode_reference, lambda *a: paged_decode_v2_triton(*a, blocks_per_split=2)):
        a, b = fn(q, ident, 0.25), fn(q, shuffled, 0.25)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@settings(max_examples=10, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking
@given(
    seed=st.integers(0, 10_000),
    bits=st.sampled_from([(2, 2), (4, 4), (4, 2), (2, 4)]),
    shape=st.sampled_from([(16, 16, [2, 1], [5, 16]), (32, 16, [2, 0], [1, 9]), (32, 32, [1, 2], [0, 31])]),
    M=st.sampled_from([1, 2, 4]),
    split=st.sampled_from([1, 2, None]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_kernel_within_the_contract_of_attention_over_the_dequantized_cache(seed, bits, shape, M, split, dtype):
    """Invariant: for any block size N (a multiple of the key group G), partially filled open block, GQA group,
    bits and split of the table over programs, the kernel and the reference meet the tolerance contract
    (docs/protocols.md) per sequence, and agree with each other within half of it."""
    N, G, blocks, tails = shape
    cache, _, gen = make_paged(seed, 2, 64, N, blocks, tails, bits=bits, G=G, dtype=dtype)
    q = _query(gen, len(blocks), 2, M, 64, dtype, amp=1 + seed % 4)
    out, lse = paged_decode_v2_triton(q, cache, 0.2, blocks_per_split=split)
    check_contract(out, lse, q, cache, 0.2)
    r_out, r_lse = paged_decode_reference(q, cache, 0.2)
    check_contract(r_out, r_lse, q, cache, 0.2)
    rel, lse_err = within_tolerance(out.view(-1, 1, 64), lse.view(-1, 1, 1), r_out.view(-1, 1, 64),
                                    r_lse.view(-1, 1, 1))  # fmt: skip
    assert rel <= OUT_RTOL / 2 and lse_err <= LSE_ATOL / 2


@pytest.mark.parametrize(("bits", "M"), [((2, 2), 1), ((4, 4), 4), ((2, 4), 4)])
def test_contract_at_fixed_cases(bits, M):
    """GQA groups 1 and 4, 2 and 4 bits, a partially filled open block, split over programs (what the GPU run checks
    without hypothesis)."""
    cache, _, gen = make_paged(3, 2, 64, 16, [3, 1], [5, 11], bits=bits)
    q = _query(gen, 2, 2, M, 64, torch.float16, amp=3.0)
    check_contract(*paged_decode_v2_triton(q, cache, 0.2, blocks_per_split=1), q, cache, 0.2)


def test_the_open_block_is_read_up_to_its_length():
    # a planted value in the last live tail row, with a key that takes all the attention; the rows past it are garbage
    cache, _, _ = make_paged(5, 1, 32, 16, [2], [6], bits=(4, 4), GV=8)
    cache.tail_k[0, :, 5] = 0.0
    cache.tail_k[0, :, 5, 0] = 30.0
    cache.tail_v[0, :, 5] = 100.0
    q = torch.zeros(1, 2, 32, device=DEVICE, dtype=torch.float16)
    q[..., 0] = 1.0
    for out, _ in (paged_decode_v2_triton(q, cache, 1.0), paged_decode_reference(q, cache, 1.0)):
        assert torch.allclose(out, torch.full_like(out, 100.0), rtol=1e-3)


def test_dispatch_takes_the_kernel_where_use_triton_says(monkeypatch):
    cache, _, gen = make_paged(7, 2, 64, 16, [2, 1], [3, 8])
    q = _query(gen, 2, 2, 2, 64, torch.float16)
    ref = paged_decode_reference(q, cache, 0.2)
    if DEVICE.type == "cpu":
        got = kivi_decode_v2_paged(q, cache, 0.2)  # CPU: the reference
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return paged_decode_v2_triton(*args, **kwargs)

    monkeypatch.setattr(decode_v2, "use_triton", lambda t: True)
    monkeypatch.setattr(kernel_module, "paged_decode_v2_triton", spy)
    got = kivi_decode_v2_paged(q, cache, 0.2, blocks_per_split=1)
    assert calls == [dict(blocks_per_split=1)]
    want = paged_decode_v2_triton(q, cache, 0.2, blocks_per_split=1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    small, _, gen = make_paged(7, 1, 32, 16, [1], [2], GV=8, bits=(2, 2))  # 8 code bytes per token: the reference
    assert not supported(small)
    q = _query(gen, 1, 1, 2, 32, torch.float16)
    got, want = kivi_decode_v2_paged(q, small, 0.2), paged_decode_reference(q, small, 0.2)
    assert torch.equal(got[0], want[0]) and len(calls) == 1


def _fields(cache: PagedPackedKIVI) -> dict:
    return {f: getattr(cache, f) for f in PagedPackedKIVI.__dataclass_fields__}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(kbits=8), ValueError, "kbits"),
        (dict(vbits=3), ValueError, "vbits"),
        (dict(kbits=4.0), TypeError, "kbits"),
        (dict(group=32), ValueError, r"multiple of the key group"),
        (dict(vgroup=24), ValueError, "vgroup"),
        (dict(kc=torch.zeros(4, 2, 32, 16, dtype=torch.int8)), TypeError, "kc"),
        (dict(kc=torch.zeros(4, 2, 16, 16, dtype=torch.uint8)), ValueError, "kc"),
        (dict(vs=torch.zeros(4, 2, 4, 8)), ValueError, "vs"),
        (dict(block_table=torch.zeros(2, 3)), TypeError, "block_table"),
        (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "block_table"),
        (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), ValueError, "seq_lens"),
        (dict(tail_k=[0.0]), TypeError, "tail_k"),
        (dict(tail_v=torch.zeros(2, 2, 16, 64)), TypeError, "tail_v"),
    ],
)
def test_bad_layouts_are_refused_naming_the_argument(change, error, match):
    cache, _, _ = make_paged(0, 2, 64, 16, [1, 1], [2, 3], spare=2)
    with pytest.raises(error, match=match):
        PagedPackedKIVI(**{**_fields(cache), **change})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(block_table=torch.tensor([[0, 9, 0], [1, 0, 0]], dtype=torch.int32)), "block ids outside"),
        (dict(block_table=torch.tensor([[0, -1, 0], [1, 0, 0]], dtype=torch.int32)), "block ids outside"),
        (dict(seq_lens=torch.tensor([16 * 4 + 2, 19], dtype=torch.int32)), "beyond the block_table"),
        (dict(seq_lens=torch.tensor([40, 19], dtype=torch.int32)), "whole number"),
        (dict(tail_lens=torch.tensor([17, 3], dtype=torch.int32), seq_lens=torch.tensor([49, 19])), "tail"),
        (dict(tail_lens=torch.tensor([2, 30], dtype=torch.int32)), "tail"),
    ],
)
def test_bad_contents_are_refused_by_reference_and_kernel(change, match):
    cache, _, gen = make_paged(0, 2, 64, 16, [2, 1], [2, 3], spare=2)
    bad = PagedPackedKIVI(**{**_fields(cache), **{k: v.to(DEVICE) for k, v in change.items()}})
    q = _query(gen, 2, 2, 1, 64, torch.float16)
    for fn in (paged_decode_reference, paged_decode_v2_triton, kivi_decode_v2_paged):
        with pytest.raises(ValueError, match=match):
            fn(q, bad, 0.1)


def test_bad_queries_are_refused():
    cache, _, gen = make_paged(0, 2, 64, 16, [1, 1], [2, 3])
    q = _query(gen, 2, 2, 1, 64, torch.float16)
    for fn in (paged_decode_reference, paged_decode_v2_triton):
        with pytest.raises(ValueError, match="query"):
            fn(torch.cat([q, q[:, :1]], 1), cache, 0.1)  # 3 query heads over 2 KV heads
        with pytest.raises(ValueError, match="query"):
            fn(q[:1], cache, 0.1)
        with pytest.raises(TypeError, match="query"):
            fn(q.to(torch.int32), cache, 0.1)
        with pytest.raises(TypeError, match="scale"):
            fn(q, cache, "0.1")
    with pytest.raises(ValueError, match="block_t"):
        paged_decode_v2_triton(q, cache, 0.1, block_t=8)
    with pytest.raises(ValueError, match="blocks_per_split"):
        paged_decode_v2_triton(q, cache, 0.1, blocks_per_split=0)
