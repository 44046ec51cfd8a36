"""Triton Stage-1 and Stage-2 attention == the PyTorch references under TRITON_INTERPRET=1 (compiled on a GPU)."""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from kv_sekv.kernels import biased_attention_torch
from kv_sekv.kernels.triton_attention import HAS_TRITON, biased_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)


@pytest.mark.parametrize(("B", "Hkv", "group", "Q", "N", "D"), [(1, 1, 1, 1, 5, 8), (2, 2, 2, 2, 40, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_attention_matches_reference(B, Hkv, group, Q, N, D, dtype):
    """Random bias with -inf padding and log|S| entries, a head with no entry (lse -inf, out 0), bf16 inputs."""
    assert HAS_TRITON
    g = torch.Generator().manual_seed(N)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype).to(DEVICE)
    bias = torch.log(torch.randint(1, 20, (B, Hkv, N), generator=g).float())
    bias[..., ::3] = float("-inf")
    bias[0, 0] = float("-inf")  # an empty head
    bias = bias.to(DEVICE)
    q = torch.randn(B, Hkv * group, Q, D, generator=g).to(dtype).to(DEVICE)
    got = biased_attention_triton(k, v, bias, q, 1 / math.sqrt(D), block_n=32)
    want = biased_attention_torch(k, v, bias, q, 1 / math.sqrt(D))
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert bool((got[1][0, :group] == float("-inf")).all()) and bool((got[0][0, :group] == 0).all())


@pytest.mark.parametrize(("block_n", "tiles"), [(16, 1), (16, 2), (32, 4)])
def test_biased_attention_any_split_matches_reference(block_n, tiles):
    """Entries split across programs (5, 3 and 1 splits of 70 here) and merged by log-sum-exp: the result does not
    depend on the split; a bad tile count is refused."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 70, 16, generator=g).to(DEVICE), torch.randn(1, 2, 70, 16, generator=g).to(DEVICE)
    bias = torch.log(torch.randint(1, 9, (1, 2, 70), generator=g).float())
    bias[0, 1, :40] = float("-inf")  # whole splits that see nothing
    q = torch.randn(1, 4, 2, 16, generator=g).to(DEVICE)
    got = biased_attention_triton(k, v, bias.to(DEVICE), q, 0.25, block_n=block_n, tiles=tiles)
    want = biased_attention_torch(k, v, bias.to(DEVICE), q, 0.25)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="tiles"):
        biased_attention_triton(k, v, bias.to(DEVICE), q, 0.25, tiles=0)


@pytest.mark.parametrize("N", [0, 5, 70])
def test_biased_attention_without_bias_equals_a_zero_bias(N):
    """bias=None (a bias-free resident view): no bias is read, every entry counts -- the same as a zero bias, in the
    kernel (several splits, a ragged last block) and in the reference; no entry at all gives out 0, lse -inf."""
    from kv_sekv.kernels.dispatch import biased_attention_splits

    g = torch.Generator().manual_seed(N)
    k, v = torch.randn(2, 2, N, 16, generator=g).to(DEVICE), torch.randn(2, 2, N, 16, generator=g).to(DEVICE)
    q = torch.randn(2, 4, 1, 16, generator=g).to(DEVICE)
    zero = torch.zeros(2, 2, N, device=DEVICE)
    want = biased_attention_torch(k, v, zero, q, 0.25)
    for got in (
        biased_attention_triton(k, v, None, q, 0.25, block_n=16, tiles=2),
        biased_attention_torch(k, v, None, q, 0.25),
    ):
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    outp, lsep = biased_attention_splits(k, v, None, q, 0.25)  # this device's path: [B*Hq*Q, S, D] parts
    assert outp.shape[0] == lsep.shape[0] == 8 and outp.shape[-1] == 16
    if N == 0:
        assert bool((want[1] == float("-inf")).all()) and bool((want[0] == 0).all())


def test_biased_attention_over_buffer_views_aligned_or_not():
    """Keys and values as views of a growing buffer (what the store passes): with head strides a multiple of 16 the
    kernel is told so (vector loads; `kvcodec.kernels.alignment.rows_aligned` over the batch and head strides), with
    an odd capacity and head dim it is not; both match the reference."""
    from kvcodec.kernels.alignment import rows_aligned

    g = torch.Generator().manual_seed(5)
    for cap, D, expect in ((100, 16, True), (101, 12, False)):
        kb, vb = torch.randn(2, 1, 2, cap, D, generator=g).to(DEVICE)
        k, v = kb[:, :, :70], vb[:, :, :70]
        assert rows_aligned((k, v), dims=(0, 1)) is expect
        bias = torch.log(torch.randint(1, 9, (1, 2, 70), generator=g).float()).to(DEVICE)
        q = torch.randn(1, 4, 1, D, generator=g).to(DEVICE)
        got = biased_attention_triton(k, v, bias, q, 0.25, block_n=16, tiles=2)
        want = biased_attention_torch(k, v, bias, q, 0.25)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


def test_biased_attention_reads_buffer_views_where_they_are(monkeypatch):
    """The launcher hands the kernel the store's views themselves (any strides but a unit last one), not copies: a
    `.contiguous()` of a view of a growing buffer copied the whole resident cache at every decode step."""
    import kv_sekv.kernels.triton_attention as ta

    seen = {}

    class Spy:
        def __getitem__(self, grid):
            def launch(q, k, v, b, *args, **kwargs):
                seen.update(q=q, k=k, v=v, b=b)

            return launch

    kb, vb = torch.randn(2, 1, 2, 100, 16).to(DEVICE)
    k, v = kb[:, :, :70], vb[:, :, :70]
    q = torch.randn(1, 8, 4, 16).to(DEVICE).transpose(1, 2)  # [1, 4, 8, 16] with strides of a transposed layout
    bias = torch.zeros(1, 2, 128).to(DEVICE)[..., :70]
    monkeypatch.setattr(ta, "_biased_attention_kernel", Spy())
    ta.biased_attention_splits_triton(k, v, bias, q, 0.25)
    for name, t in (("k", k), ("v", v), ("q", q), ("b", bias)):
        assert seen[name].data_ptr() == t.data_ptr() and seen[name].stride() == t.stride(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factored_attention_batch_triton_equals_reference(dtype):
    """The Stage-2 Triton kernel (under the interpreter on CPU) = the batched PyTorch reference: spans of mixed
    lengths (several token blocks of 16), ranks and raw spans, a group with several spans, one with none, GQA rows
    and two query rows, half-precision queries; an empty batch gives every group ``out = 0``, ``lse = -inf``."""
    from kv_sekv.kernels import factored_attention_batch_torch
    from kv_sekv.kernels.triton_attention import factored_attention_batch_triton

    g = torch.Generator().manual_seed(3)
    D, groups, G, Q = 16, 4, 2, 2

    def factors(L, r):
        if r == 0:
            return torch.randn(L, D, generator=g), torch.ones(D), torch.eye(D)
        return torch.randn(L, r, generator=g), torch.rand(r, generator=g), torch.randn(r, D, generator=g)

    spec = [(40, 5, 0), (3, 2, 0), (17, 0, 2), (1, 1, 3), (33, 8, 2)]  # (tokens, rank, group); group 1 has none
    kf = [tuple(t.to(DEVICE) for t in factors(L, r)) for L, r, _ in spec]
    vf = [tuple(t.to(DEVICE) for t in factors(L, max(r - 1, 0))) for L, r, _ in spec]
    group = torch.tensor([grp for _, _, grp in spec], device=DEVICE)
    q = torch.randn(groups, G, Q, D, generator=g).to(DEVICE, dtype)
    got = factored_attention_batch_triton(q[group], kf, vf, 0.3, group, groups, block_n=16)
    want = factored_attention_batch_torch(q[group], kf, vf, 0.3, group, groups)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert bool((got[0][1] == 0).all()) and bool(torch.isneginf(got[1][1]).all())
    empty = factored_attention_batch_triton(q[:0], [], [], 0.3, group[:0], groups)
    assert bool((empty[0] == 0).all()) and bool(torch.isneginf(empty[1]).all())
