"""Triton kernels == PyTorch references, under the Triton interpreter on CPU (few programs, small shapes)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_testutil import DTYPES, make_data, ulp

from kvcodec import QUANT_BITS, UniformQuantizer, kernels

triton = pytest.importorskip("triton")
# Masked padding lanes of a tile may divide by a tiny scale and overflow to -inf before being clamped and
# discarded; numpy (the interpreter) warns about it, the GPU does not.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
from kvcodec.kernels.triton_compact import compact_triton
from kvcodec.kernels.triton_quant import quantize_pack_triton, unpack_dequantize_triton

# compiled on a GPU machine; on CPU the kernels run in the interpreter (conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

shapes = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPES),
        # powers of two (register reshape), others (gathered statistics), and G >= D (one group per row)
        "G": st.sampled_from([2, 3, 4, 6, 8, 16, 48]),
        "M": st.integers(1, 2),
        "T": st.integers(1, 12),
        "D": st.integers(1, 20),
        "kind": st.integers(0, 5),
        "seed": st.integers(0, 2**31 - 1),
        "block_rows": st.sampled_from([None, 8]),
    }
)


def _assert_close_1ulp(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = (a.double() - b.double()).abs()
    assert bool((diff <= ulp(torch.maximum(a.double().abs(), b.double().abs()), a.dtype)).all())


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", QUANT_BITS)
@settings(max_examples=4, deadline=None)
@given(c=shapes)
def test_quantize_dequantize_triton_matches_reference(bits, axis, c):
    if axis == "channel":  # one program per (row, token group): keep the count small
        c = {**c, "T": min(c["T"], 2 * c["G"])}
    x = make_data(c["seed"], (c["M"], c["T"], c["D"]), c["kind"], c["dtype"])
    ref = kernels.quantize_pack_ref(x, bits, axis, c["G"])
    tri = quantize_pack_triton(x.to(DEVICE), bits, axis, c["G"], block_rows=c["block_rows"])
    for r, t in zip(ref, tri):
        assert r.dtype == t.dtype and r.shape == t.shape
        assert torch.equal(r, t.cpu())  # codes, scales and zeros bit-exact
    tail = (bits, axis, c["G"], tuple(x.shape), x.dtype)
    tri_y = unpack_dequantize_triton(*(t.to(DEVICE) for t in ref), *tail, block_rows=c["block_rows"])
    _assert_close_1ulp(tri_y.cpu(), kernels.unpack_dequantize_ref(*ref, *tail))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compact_triton_matches_boolean_indexing(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 5, generator=g).to(dtype)
    keep = torch.rand(2, 3, 9, generator=g) < 0.4
    keep[1, 2] = False  # an empty head
    for xi in (x, x.transpose(2, 3).contiguous().transpose(2, 3)):  # contiguous and strided input
        flat, lengths = compact_triton(xi.to(DEVICE), keep.to(DEVICE), block_rows=32)
        assert torch.equal(flat.cpu(), x[keep])
        assert torch.equal(lengths.cpu(), keep.sum(-1))
    flat, lengths = compact_triton(x.to(DEVICE), torch.zeros_like(keep).to(DEVICE))
    assert flat.shape == (0, 5) and int(lengths.sum()) == 0


def test_dispatch_uses_reference_on_cpu():
    x = torch.randn(2, 7, 10)
    assert not kernels.use_triton(x)
    for r, d in zip(kernels.quantize_pack_ref(x, 3, "token", 4), kernels.quantize_pack(x, 3, "token", 4)):
        assert torch.equal(r, d)
    keep = torch.rand(1, 2, 7) < 0.5
    flat, lengths = kernels.compact(x[None], keep)
    assert torch.equal(flat, x[None][keep]) and torch.equal(lengths, keep.sum(-1))


def test_compact_rejects_bad_mask():
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="keep"):
        kernels.compact(x, torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep"):
        kernels.compact(x, torch.ones(1, 2, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU path)")
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", QUANT_BITS)
def test_cuda_dispatch_matches_cpu_reference(bits, axis):
    for dtype in DTYPES:
        x = make_data(7, (3, 40, 128), 0, dtype)
        q = UniformQuantizer(bits, axis, 32)
        q_gpu, q_cpu = q.quantize(x.cuda()), q.quantize(x)
        for a, b in ((q_gpu.codes, q_cpu.codes), (q_gpu.scales, q_cpu.scales), (q_gpu.zeros, q_cpu.zeros)):
            assert torch.equal(a.cpu(), b)
        _assert_close_1ulp(q.dequantize(q_gpu).cpu(), q.dequantize(q_cpu))
        keep = torch.rand(3, 40) < 0.5
        flat, _lengths = kernels.compact(x.cuda()[None], keep.cuda()[None])
        assert torch.equal(flat.cpu(), x[None][keep[None]])
