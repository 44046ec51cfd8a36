"""The Triton kernel over KIVI's decode layout (kv_baselines.quant.kivi_decode_triton), run by Triton's interpreter on
CPU (the package's conftest sets TRITON_INTERPRET): equal to reference attention over read() and to the PyTorch
reference of the same signature, over every part of the layout (quantized keys and values, key residual, the value
FIFO before and after its ring turns), any split of the entries over programs, and through KIVIStore.attend. On a
machine with a GPU the stores live on it (compiled kernels)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_baselines.quant import KIVIStore, UniformQuantizer, kivi_decode, kivi_tiers
from kv_baselines.quant.kivi_decode import decode_attention_ref
from kv_baselines.quant.kivi_decode_triton import decode_attention_triton
from kvcore import Plan, reference_attention

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _decoding(seed, bits, B, H, T, D, G, R, steps, dtype, value_group=None):
    gen = torch.Generator().manual_seed(seed)
    vq = UniformQuantizer(bits, "token", value_group or G)
    store = KIVIStore(UniformQuantizer(bits, "channel", G), vq, residual=R)
    keep = torch.ones(B, H, T, dtype=torch.bool, device=DEVICE)
    plan = Plan(kivi_tiers(keep, bits, R, "keys"), kivi_tiers(keep, bits, R, "values"))
    k, v = torch.randn(B, H, T, D, generator=gen) * 2, torch.randn(B, H, T, D, generator=gen)
    store.write(k.to(DEVICE, dtype), v.to(DEVICE, dtype), plan, torch.arange(T, device=DEVICE).expand(B, T))
    for i in range(steps):
        nk, nv = torch.randn(B, H, 1, D, generator=gen) * 2, torch.randn(B, H, 1, D, generator=gen)
        store.append(nk.to(DEVICE, dtype), nv.to(DEVICE, dtype), torch.full((B, 1), T + i, device=DEVICE))
    assert store._dec is not None
    return store, gen


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    bits=st.sampled_from([1, 2, 4, 8]),
    steps=st.integers(1, 20),
    shape=st.sampled_from([(1, 2, 3, 16, 4, 8, 4), (2, 3, 1, 64, 32, 32, 32), (1, 1, 4, 32, 8, 8, 16)]),
    split=st.sampled_from([(16, 1), (16, 3), (32, 2), (None, None)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_kernel_equals_reference_attention_over_read(seed, bits, steps, shape, split, dtype):
    """Invariant: the kernel's output and log-sum-exp equal reference attention over ``read()`` (whose entries are
    dequantized and rounded to the cache dtype exactly as the kernel does in registers) up to float32 summation
    order, whatever the split of the entries over programs; the PyTorch reference of the same signature (which does
    not round to the cache dtype) agrees within that rounding."""
    B, H, group, D, G, R, value_group = shape
    store, gen = _decoding(seed, bits, B, H, 2 * R + 3, D, G, R, steps, dtype, value_group)
    q = torch.randn(B * H, group, D, generator=gen).to(DEVICE, dtype)
    block_t, tiles = split
    out, lse = decode_attention_triton(store._dec, q, 0.3, block_t=block_t, tiles=tiles)
    ref_out, ref_lse = reference_attention(store.read(), q.view(B, H * group, 1, D), 0.3)
    assert torch.allclose(out.view(B, H * group, 1, D), ref_out, atol=2e-5, rtol=1e-5)
    assert torch.allclose(lse.view(B, H * group, 1), ref_lse, atol=2e-5, rtol=1e-5)
    store, gen = _decoding(seed, bits, B, H, 2 * R + 3, D, G, R, steps, dtype, value_group)  # read() left the layout
    r_out, r_lse = decode_attention_ref(store._dec, q, 0.3)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    assert torch.allclose(out, r_out, atol=tol, rtol=tol) and torch.allclose(lse, r_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("steps", [0, 5, 8, 13])
def test_the_value_fifo_is_read_in_ring_order(steps):
    # the ring before it fills (head 0) and after it turns (head != 0): the newest token gets a key that takes all
    # the attention and a planted value in its ring slot, so the output is that value only if the kernel pairs
    # entry t with ring slot (t - tv + head) mod nv
    store, _ = _decoding(7, 2, 1, 1, 19, 16, 4, 8, steps + 1, torch.float32)
    dec = store._dec
    assert dec.nr > 0  # the newest key is a residual row
    newest = (dec.head + dec.nv - 1) % dec.nv  # the ring slot of the newest token's value
    dec.kr[:, dec.nr - 1] = 0.0
    dec.kr[:, dec.nr - 1, 0] = 50.0
    dec.ring[:, newest] = 100.0
    q = torch.zeros(1, 1, 16, device=DEVICE)
    q[..., 0] = 1.0
    out, _ = decode_attention_triton(dec, q, 1.0, block_t=16, tiles=1)
    ref, _ = decode_attention_ref(dec, q, 1.0)
    assert torch.allclose(out, ref, atol=1e-4)
    assert torch.allclose(out, torch.full_like(out, 100.0), atol=1e-3)


def test_store_attend_takes_the_kernel_where_triton_is_used(monkeypatch):
    # KIVIStore.attend over its decode layout dispatches on the cache's device: forced here onto the kernel, it is
    # called and gives reference attention over read()
    store, gen = _decoding(3, 4, 1, 2, 40, 32, 8, 8, 3, torch.float16)
    calls = []
    real = decode_attention_triton

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kivi_decode, "use_triton", lambda t: True)
    monkeypatch.setattr("kv_baselines.quant.kivi_decode_triton.decode_attention_triton", spy)
    q = torch.randn(1, 4, 2, 32, generator=gen).to(DEVICE, torch.float16)
    out, lse = store.attend(q, 0.25)
    assert calls == [torch.Size([2, 4, 32])]
    ref_out, ref_lse = reference_attention(store.read(), q, 0.25)
    assert torch.allclose(out, ref_out, atol=2e-5) and torch.allclose(lse, ref_lse, atol=2e-5)


def test_an_empty_query_gives_empty_results():
    store, _ = _decoding(0, 2, 1, 1, 19, 16, 4, 8, 1, torch.float32)
    out, lse = decode_attention_triton(store._dec, torch.zeros(1, 0, 16, device=DEVICE), 1.0)
    assert out.shape == (1, 0, 16) and lse.shape == (1, 0, 1)


def test_shapes_the_kernel_does_not_take_attend_through_the_reference(monkeypatch):
    # a head dim that is not a power of two: the kernel refuses it by name, the store attends through the reference
    store, gen = _decoding(2, 2, 1, 1, 40, 48, 8, 8, 2, torch.float32, 16)
    q = torch.randn(1, 2, 48, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        decode_attention_triton(store._dec, q, 1.0)
    monkeypatch.setattr(kivi_decode, "use_triton", lambda t: True)
    out, lse = store._dec.attend(q, 1.0)
    ref_out, ref_lse = decode_attention_ref(store._dec, q, 1.0)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("bits", [2, 4])
def test_the_matrix_unit_path_in_float16_keeps_float32_accuracy(bits):
    """The cache-dtype path (float16 query and cache on tl.dot, the probabilities split into two float16 parts) stays
    within float32-level error of reference attention (one cast of p would be off by ~1e-3); a float32 query with
    tensor_cores=True is refused. (The bfloat16 twin runs on GPUs only: the interpreter's bfloat16 tl.dot is wrong.)"""
    store, gen = _decoding(1, bits, 1, 2, 70, 64, 32, 32, 5, torch.float16)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE, torch.float16)
    out, lse = decode_attention_triton(store._dec, q, 0.2, tensor_cores=True)
    ref_out, ref_lse = reference_attention(store.read(), q.view(1, 8, 1, 64), 0.2)
    torch.testing.assert_close(out.view_as(ref_out), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.view_as(ref_lse), ref_lse, atol=2e-5, rtol=2e-5)
    store, _ = _decoding(1, bits, 1, 2, 70, 64, 32, 32, 5, torch.float16)
    with pytest.raises(ValueError, match="tensor_cores"):
        decode_attention_triton(store._dec, q.float(), 0.2, tensor_cores=True)


@pytest.mark.parametrize(("D", "G", "GV", "bits"), [(16, 16, 16, 2), (32, 32, 32, 1), (16, 4, 16, 8)])
def test_edge_shapes_one_key_group_and_one_value_group_per_token(D, G, GV, bits):
    # one quantized key group (its scales [S, D, 1] are a strided view: size-1 dims carry any stride) and a value
    # group as wide as the head (one parameter per token)
    store, gen = _decoding(1, bits, 1, 2, 40, D, G, max(16, G), 5, torch.float32, GV)
    q = torch.randn(2, 3, D, generator=gen).to(DEVICE)
    out, lse = decode_attention_triton(store._dec, q, 0.3)
    ref_out, ref_lse = reference_attention(store.read(), q.view(1, 6, 1, D), 0.3)
    torch.testing.assert_close(out.view_as(ref_out), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.view_as(ref_lse), ref_lse, atol=2e-5, rtol=1e-5)


def test_a_decode_step_on_the_gpu_path_reads_nothing_on_the_host(monkeypatch):
    """With the value checks off (an accelerator's default) and the GPU path forced on (interpreter), a decode step
    -- append (the value FIFO's flush through the fused quantize kernel) and attend (this kernel) -- reads no
    tensor value on the host, and still equals reference attention over read()."""
    from kv_baselines.quant import token_quant
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    store, gen = _decoding(4, 2, 1, 2, 80, 64, 32, 32, 1, torch.float32)
    monkeypatch.setattr(kivi_decode, "use_triton", lambda t: True)
    monkeypatch.setattr(token_quant, "use_triton", lambda t: True)
    q = torch.randn(1, 4, 1, 64, generator=gen).to(DEVICE)
    with value_checks(False), HostReads(sites=True) as reads:
        for t in range(81, 85):  # the FIFO turns every step; no key block fills (16 -> 20 residual keys of 32)
            kv = torch.randn(2, 1, 2, 1, 64, generator=gen).to(DEVICE)
            store.append(kv[0], kv[1], torch.full((1, 1), t, device=DEVICE))
            out, lse = store.attend(q, 0.125)
    assert reads.total == 0, dict(reads.by_site)
    ref_out, ref_lse = reference_attention(store.read(), q, 0.125)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose rows are one slot longer (strides no longer multiples of 16)."""
    out = torch.empty(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=t.device)[..., : t.shape[-1]]
    out.copy_(t)
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_aligned_fast_path_equals_the_general_path(bits, dtype):
    """Invariant: the decode layout keeps its code and parameter rows 16-slot aligned, so tiles whose entries are all
    quantized take the unmasked path (codes read as 32-bit words); the same state with misaligned rows takes the
    general (masked, byte-wise) path for every tile; both dequantize to the same entries, so they agree up to float32
    summation order, and equal reference attention over read()."""
    from kv_baselines.quant.kivi_decode import ALIGN

    store, gen = _decoding(5, bits, 1, 2, 150, 32, 16, 32, 9, dtype)
    dec = store._dec
    assert dec.tk >= 64 and dec.tv >= 64  # several whole tiles of quantized entries on both sides
    for t in (dec.kc, dec.vc, dec.vs, dec.vz):
        assert t.stride(0) % ALIGN == 0 and t.stride(1) % ALIGN == 0
    q = torch.randn(2, 3, 32, generator=gen).to(DEVICE, dtype)
    out, lse = decode_attention_triton(dec, q, 0.3, block_t=16, tiles=2)
    for name in ("kc", "vc", "vs", "vz"):
        setattr(dec, name, _unaligned(getattr(dec, name)))
    slow_out, slow_lse = decode_attention_triton(dec, q, 0.3, block_t=16, tiles=2)
    torch.testing.assert_close(out, slow_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, slow_lse, atol=1e-5, rtol=1e-5)
    ref_out, ref_lse = reference_attention(store.read(), q.view(1, 6, 1, 32), 0.3)
    torch.testing.assert_close(out.view_as(ref_out), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.view_as(ref_lse), ref_lse, atol=2e-5, rtol=1e-5)


def test_aligned_path_can_be_forced_off_or_insisted_on():
    # aligned_path=False runs every tile through the general path (a benchmark baseline) with the same result;
    # True refuses misaligned buffers by name, and a non-bool is a TypeError
    store, gen = _decoding(6, 2, 1, 2, 150, 32, 16, 32, 9, torch.float32)
    dec = store._dec
    q = torch.randn(2, 3, 32, generator=gen).to(DEVICE)
    out, lse = decode_attention_triton(dec, q, 0.3, block_t=16, tiles=2, aligned_path=True)
    off_out, off_lse = decode_attention_triton(dec, q, 0.3, block_t=16, tiles=2, aligned_path=False)
    torch.testing.assert_close(out, off_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, off_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="aligned_path"):
        decode_attention_triton(dec, q, 0.3, aligned_path="yes")
    dec.vc = _unaligned(dec.vc)
    with pytest.raises(ValueError, match="aligned_path=True"):
        decode_attention_triton(dec, q, 0.3, aligned_path=True)
