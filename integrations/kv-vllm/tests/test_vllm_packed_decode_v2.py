"""The packed backend's decode path through decode attention v2 (kv_vllm.packed: paged_view, paged_attention's
``decode="v2"``), without vLLM.

Pools are laid out as vLLM's CPU view (``[num_blocks, H, N, C]`` in the model dtype) and filled by the backend's own
packing (``OpenBlocks`` staging + ``pack_complete``), blocks at shuffled pool positions; unused pool blocks hold
random bytes (NaNs among them), so a path that reads a block it should not fails. Checked: the pool's typed views
are the kernel's layout without a copy, the v2 decode path within docs/protocols.md's tolerance contract of the
previous PyTorch path (``decode="torch"``, attention over ``read()``'s dequantized entries), the capacity figures
recomputed from the views, and the paged Triton kernel on the backend's own pool view (interpreter without CUDA).
"""

import math

import pytest
import torch

import kvcodec.decode_v2 as decode_v2
from kv_vllm.packed import (
    DECODE_PATHS,
    OpenBlocks,
    PageFormat,
    pack_complete,
    page_bytes_view,
    paged_attention,
    paged_view,
)
from kvcodec.decode_v2 import (
    LSE_ATOL,
    OUT_RTOL,
    attention_over_dequantized,
    paged_contract_errors,
    paged_decode_reference,
    row_errors,
    within_tolerance,
)
from kvcodec.uniform import UniformQuantizer

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_pool(seed, dtype, bits, blocks, tails, H=2, D=64, N=16, GV=16, spare=3, queries=None):
    """A decode step of ``len(blocks)`` requests over a pool packed by the backend.

    Request ``b`` has ``blocks[b]`` packed blocks and ``tails[b]`` (1 .. N) tokens in its open block, the last of them
    this step's; its one query is row ``b`` unless ``queries[b] > 1`` (a prefill chunk of that many tokens, all in the
    open block). Returns a dict: ``fmt``, ``pool`` (vLLM's layer view), ``pages``, ``staged``, ``table``
    ``[B, width]`` (unused entries name a garbage block), ``lens``, ``qsl`` and ``gen``."""
    gen = torch.Generator().manual_seed(seed)
    fmt = PageFormat(N, H, D, dtype, bits, GV)
    e = _nbytes(dtype)
    total = sum(blocks) + len(blocks)  # packed blocks and one open block per request
    nb = total + spare
    raw = torch.randint(0, 256, (nb, H, N, fmt.token_bytes), generator=gen, dtype=torch.uint8)
    pool = raw.view(dtype).to(DEVICE)  # [nb, H, N, token_bytes / e] in the model dtype, random contents
    assert pool.shape[-1] == fmt.token_bytes // e
    pages = page_bytes_view(pool)
    staged = OpenBlocks(H, N, D, dtype)
    ids = torch.randperm(nb, generator=gen)[:total].tolist()  # shuffled pool positions
    width = max(blocks) + 2
    table = torch.full((len(blocks), width), ids[0], dtype=torch.int32)
    queries = queries or [1] * len(blocks)
    lens, qsl, at, step = [], [0], 0, []
    for b, (n, nt) in enumerate(zip(blocks, tails, strict=True)):
        assert 1 <= nt <= N and queries[b] <= nt
        mine = ids[at : at + n + 1]
        at += n + 1
        table[b, : n + 1] = torch.tensor(mine, dtype=torch.int32)
        T = n * N + nt
        k = (torch.randn(T, H, D, generator=gen) * 2 + torch.randn(1, H, D, generator=gen)).to(DEVICE, dtype)
        v = torch.randn(T, H, D, generator=gen).to(DEVICE, dtype)
        slots = torch.tensor([mine[t // N] * N + t % N for t in range(T)])
        c = T - queries[b]  # tokens of earlier steps; this step's are staged after the packing
        staged.write(k[:c], v[:c], slots[:c])
        step.append((k[c:], v[c:], slots[c:]))
        lens.append(T)
        qsl.append(qsl[-1] + queries[b])
    pack_complete(fmt, staged, pages)  # earlier steps' complete blocks, packed once as the backend does
    for k, v, slots in step:
        staged.write(k, v, slots)  # the step's tokens (a block they complete is packed after the step's attention)
    return dict(fmt=fmt, pool=pool, pages=pages, staged=staged, table=table.to(DEVICE), lens=torch.tensor(lens),
                qsl=torch.tensor(qsl), gen=gen)  # fmt: skip


def view_of(p) -> decode_v2.PagedPackedKIVI:
    """The decode step's PagedPackedKIVI, as the backend's v2 path builds it (open blocks stacked from the staging)."""
    N, lens, table = p["fmt"].block_size, p["lens"].tolist(), p["table"].cpu()
    n = [(L - 1) // N for L in lens]
    opens = [p["staged"].get(int(table[b, nb])) for b, nb in enumerate(n)]
    tails = torch.tensor([L - nb * N for L, nb in zip(lens, n, strict=True)], dtype=torch.int32)
    return paged_view(
        p["fmt"], p["pages"], torch.stack([k for k, _ in opens]), torch.stack([v for _, v in opens]), p["table"],
        p["lens"].to(torch.int32).to(DEVICE), tails.to(DEVICE),
    )  # fmt: skip


def attend(p, q, decode, scale=0.2):
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], device=DEVICE)  # float32: the contract's output
    paged_attention(q, p["pages"], p["staged"], p["fmt"], p["qsl"], p["lens"], p["table"], scale, out, decode=decode)
    return out.view(q.shape)


def test_pages_are_the_kernel_layout_viewed_without_a_copy():
    """pack() stores token-inner codes and value parameters: the views equal UniformQuantizer's codes and parameters
    transposed (the layout of kvcodec.decode_v2.PagedPackedKIVI), share the pool's storage and follow its writes."""
    gen = torch.Generator().manual_seed(0)
    fmt = PageFormat(32, 2, 64, torch.float16, 4, 32)
    k, v = (torch.randn(3, 2, 32, 64, generator=gen).half() for _ in range(2))
    pool = torch.zeros(5, 2, 32, fmt.token_bytes // 2, dtype=torch.float16)
    pages = page_bytes_view(pool)
    pages[1:4] = fmt.pack(k, v)
    f = fmt.fields(pages)
    kq = UniformQuantizer(4, "channel", 32).quantize(k)
    vq = UniformQuantizer(4, "token", 32).quantize(v)
    t = lambda x: x.transpose(-1, -2)  # noqa: E731
    want = dict(kc=t(kq.codes), ks=t(kq.scales), kz=t(kq.zeros), vc=t(vq.codes), vs=t(vq.scales), vz=t(vq.zeros))
    base, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * 2
    for name, x in want.items():
        assert torch.equal(f[name][1:4], x), name
        assert base <= f[name].data_ptr() < end and f[name].stride(-1) == 1, name  # a view, contiguous rows
    pages[2] = 0
    assert not bool(f["kc"][2].any()) and bool(f["kc"][1].any())  # writes show through
    cache = paged_view(
        fmt, pages, torch.zeros(1, 2, 32, 64, dtype=torch.float16), torch.zeros(1, 2, 32, 64, dtype=torch.float16),
        torch.tensor([[1, 3]]), torch.tensor([65]), torch.tensor([1]),
    )  # fmt: skip
    assert cache.kc.data_ptr() == f["kc"].data_ptr() and (cache.group, cache.vgroup) == (32, 32)


@pytest.mark.parametrize("bits", [8, 16])
def test_the_paged_view_refuses_8_and_16_bit_pages(bits):
    fmt = PageFormat(32, 2, 64, torch.float16, bits, 32)
    pages = fmt.pack(torch.zeros(1, 2, 32, 64), torch.zeros(1, 2, 32, 64))
    t = torch.zeros(1, 2, 32, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="paged decode layout takes"):
        paged_view(fmt, pages, t, t, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), torch.tensor([1]))


@pytest.mark.parametrize(("bits", "dtype"), [(4, torch.float16), (2, torch.float16), (4, torch.bfloat16),
                                             (2, torch.bfloat16), (4, torch.float32), (2, torch.float32)])  # fmt: skip
def test_capacity_recomputed_from_the_pool_views(bits, dtype):
    """Llama-3-8B's layer (8 KV heads x 128, 32-token blocks, value groups of 32): the bytes a block's views cover,
    rounded up to whole dtype elements per (head, token), against stock vLLM's block. The in-pool format did not
    grow: 3.2x at 4 bits and 5.33x at 2 bits for 16-bit models (docs/results/2026-11-28-vllm-backend.md)."""
    fmt = PageFormat(32, 8, 128, dtype, bits, 32)
    e = _nbytes(dtype)
    pages = fmt.pack(torch.zeros(1, 8, 32, 128), torch.zeros(1, 8, 32, 128))
    covered = sum(x[0, 0].numel() * x.element_size() for x in fmt.fields(pages).values())  # one head's region
    per_token = math.ceil(covered / 32 / e) * e
    ratio = (2 * 128 * e) / per_token
    assert per_token == fmt.token_bytes and ratio == pytest.approx(fmt.capacity_ratio)
    figure = {(4, 2): 3.2, (2, 2): 16 / 3, (4, 4): 16 / 3, (2, 4): 8.0}[(bits, e)]
    assert ratio == pytest.approx(figure)


def _allowance(p, q, scale):
    """Per query row (``[B, Hq]``): the read() reference output, the float32-dequantization reference output and the
    contract's allowance against read(), ``OUT_RTOL + 2 e_out`` (e_out: read()'s own rounding error)."""
    cache = view_of(p)
    H, D = cache.H, cache.D
    M = q.shape[1] // H
    ref, exact, allow = [], [], []
    for b in range(cache.B):
        seq = cache.sequence(b)
        qb = q[b].view(H, M, D)
        r, x = attention_over_dequantized(qb, seq, scale), attention_over_dequantized(qb, seq, scale, rounded=False)
        frel, _ = row_errors(*x, *r)
        ref.append(r[0].reshape(H * M, D))
        exact.append(x[0].reshape(H * M, D))
        allow.append((OUT_RTOL + 2 * frel).reshape(H * M))
    return torch.stack(ref), torch.stack(exact), torch.stack(allow)


def _rel(a, b):
    z = torch.zeros(*a.shape[:-1], 1, device=a.device)
    return row_errors(a, z, b, z)[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("bits", [2, 4])
def test_v2_decode_within_the_contract_of_the_previous_path(bits, M, dtype):
    """Decode steps of 3 requests (partial open blocks, one with no packed block yet, blocks shuffled in the pool):
    the previous PyTorch path is attention over read()'s entries of the same pool; the v2 path is within the
    tolerance contract of it per query row (OUT_RTOL + 2 e_out) and within OUT_RTOL of the float32 dequantization."""
    p = make_pool(bits * 10 + M, dtype, bits, blocks=[3, 0, 2], tails=[5, 9, 16])
    q = (torch.randn(3, 2 * M, 64, generator=p["gen"]) * 2).to(DEVICE, dtype)
    old, new = attend(p, q, "torch"), attend(p, q, "v2")
    ref, exact, allow = _allowance(p, q, 0.2)
    assert float(_rel(old, ref).max()) < 1e-5  # the previous path: attention over read()'s entries
    assert bool((_rel(new, old) <= allow).all()), float((_rel(new, old) / allow).max())
    assert float(_rel(new, exact).max()) <= OUT_RTOL
    assert float(_rel(new, old).max()) > 0  # the paths differ (folded formulation), so the comparison is not vacuous


@pytest.mark.parametrize("bits", [2, 4])
def test_prefill_chunks_and_8_bit_pages_keep_the_previous_path(bits):
    """In a mixed step, only one-query requests take v2: a prefill chunk's rows equal the torch path bit for bit.
    8-bit pages (the paged layout refuses them) take the torch path whatever ``decode`` says."""
    p = make_pool(7, torch.float16, bits, blocks=[2, 1, 1], tails=[6, 4, 10], queries=[1, 3, 1])
    q = torch.randn(5, 4, 64, generator=p["gen"]).to(DEVICE, torch.float16)
    old, new = attend(p, q, "torch"), attend(p, q, "v2")
    assert torch.equal(old[1:4], new[1:4]) and not torch.equal(old[0], new[0])
    p8 = make_pool(7, torch.float16, 8, blocks=[2, 1], tails=[6, 4])
    q = torch.randn(2, 4, 64, generator=p8["gen"]).to(DEVICE, torch.float16)
    assert torch.equal(attend(p8, q, "torch"), attend(p8, q, "v2"))
    with pytest.raises(ValueError, match="decode must be one of"):
        attend(p8, q, "triton")
    assert DECODE_PATHS == ("v2", "torch")


def test_v2_decode_counts_packed_reads():
    p = make_pool(3, torch.float16, 4, blocks=[3, 0, 2], tails=[5, 9, 16])
    q = torch.randn(3, 2, 64, generator=p["gen"]).to(DEVICE, torch.float16)
    stats = {}
    out = torch.zeros(3, 2 * 64, device=DEVICE)
    paged_attention(q, p["pages"], p["staged"], p["fmt"], p["qsl"], p["lens"], p["table"], 0.2, out, stats)
    assert stats == {"packed_reads": 5}


@pytest.mark.parametrize(("bits", "M"), [(2, 1), (4, 2)])
def test_triton_kernel_on_the_backend_pool_view(bits, M, monkeypatch):
    """The paged Triton kernel (interpreter without CUDA) over the backend's own pool view agrees with the paged
    reference within half the contract and meets the contract; and the backend's decode path dispatched to it
    (use_triton forced) gives the kernel's output."""
    triton = pytest.importorskip("triton")  # noqa: F841
    from kvcodec.kernels.triton_decode_v2_paged import paged_decode_v2_triton, supported

    p = make_pool(11 + bits, torch.float16, bits, blocks=[2, 1], tails=[5, 16])
    q = (torch.randn(2, 2 * M, 64, generator=p["gen"]) * 2).to(DEVICE, torch.float16)
    cache = view_of(p)
    assert supported(cache)
    out, lse = paged_decode_v2_triton(q, cache, 0.2, blocks_per_split=1)
    e = paged_contract_errors(out, lse, q, cache, 0.2)
    assert e["out_f32"] <= OUT_RTOL and e["lse_f32"] <= LSE_ATOL and e["out_ratio"] <= 1 and e["lse_ratio"] <= 1, e
    r_out, r_lse = paged_decode_reference(q, cache, 0.2)
    rel, dl = within_tolerance(out.view(-1, 1, 64), lse.view(-1, 1, 1), r_out.view(-1, 1, 64), r_lse.view(-1, 1, 1))
    assert rel <= OUT_RTOL / 2 and dl <= LSE_ATOL / 2
    monkeypatch.setattr(decode_v2, "use_triton", lambda t: True)
    got = attend(p, q, "v2")
    want, _ = paged_decode_v2_triton(q, cache, 0.2, check=False)
    assert torch.equal(got, want)
