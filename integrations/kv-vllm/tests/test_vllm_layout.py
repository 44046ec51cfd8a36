"""Gather/scatter on synthetic paged tensors laid out as vLLM 0.32's backends document them.

The reference views are the backends' own reads of the cache: CPU_ATTN re-views each page as
``kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)``; FLASH_ATTN/TRITON_ATTN split the content axis with
``kv_cache.transpose(1, 2).split(D, dim=-1)``, over a logical ``[B, H, N, 2D]`` view whose physical order may be
``LBNHC`` (token-major, CUDA's default) or ``LBHNC``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_vllm import gather_blocks, layout_for_backend, scatter_blocks


def backend_kv(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as the backend reads them, both as [B, N, H, D]."""
    B, H, N, C = kv_cache.shape
    if layout == "cpu":
        key_cache, value_cache = kv_cache.view(B, H, 2 * N, C // 2).chunk(2, dim=2)  # cpu_attn.py
        return key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(C // 2, dim=-1)  # flash_attn.py
    return key_cache, value_cache


def make_cache(B: int, H: int, N: int, D: int, layout: str, physical: str, dtype: torch.dtype) -> torch.Tensor:
    if physical == "LBNHC":  # logical [B, H, N, C] over token-major memory [B, N, H, C]
        return torch.randn(B, N, H, 2 * D).to(dtype).transpose(1, 2)
    return torch.randn(B, H, N, 2 * D).to(dtype)


shapes = st.tuples(st.integers(1, 6), st.integers(1, 3), st.sampled_from([1, 2, 4, 16]), st.sampled_from([2, 4, 8]))
setups = st.sampled_from([("cpu", "LBHNC"), ("split_last", "LBHNC"), ("split_last", "LBNHC")])
dtypes = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])


@settings(max_examples=40, deadline=None)
@given(shape=shapes, setup=setups, dtype=dtypes, data=st.data())
def test_gather_reads_what_the_backend_reads(shape, setup, dtype, data):
    """gather_blocks(block ids) == the backend's keys/values of those blocks, token-major, bit for bit."""
    B, H, N, D = shape
    layout, physical = setup
    kv = make_cache(B, H, N, D, layout, physical, dtype)
    ids = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B))
    keys, values = gather_blocks(kv, ids, layout)
    ref_k, ref_v = backend_kv(kv, layout)
    assert keys.shape == values.shape == (len(ids), N, H, D)
    assert torch.equal(keys, ref_k[ids]) and torch.equal(values, ref_v[ids])


@settings(max_examples=40, deadline=None)
@given(shape=shapes, setup=setups, dtype=dtypes, data=st.data())
def test_scatter_writes_what_the_backend_reads_and_nothing_else(shape, setup, dtype, data):
    """After scatter_blocks, the backend reads the new pages in the target blocks; other blocks are unchanged."""
    B, H, N, D = shape
    layout, physical = setup
    kv = make_cache(B, H, N, D, layout, physical, dtype)
    before = kv.clone()
    ids = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B, unique=True))
    keys = torch.randn(len(ids), N, H, D).to(dtype)
    values = torch.randn(len(ids), N, H, D).to(dtype)
    scatter_blocks(kv, ids, keys, values, layout)
    ref_k, ref_v = backend_kv(kv, layout)
    assert torch.equal(ref_k[ids], keys) and torch.equal(ref_v[ids], values)
    others = [b for b in range(B) if b not in ids]
    assert torch.equal(kv[others], before[others])
    k2, v2 = gather_blocks(kv, ids, layout)  # and the round trip
    assert torch.equal(k2, keys) and torch.equal(v2, values)


def test_cpu_layout_is_not_split_last():
    """The two layouts really differ (a connector using the wrong one would load wrong KV)."""
    kv = torch.randn(2, 1, 4, 8)
    k_cpu, _ = gather_blocks(kv, [0], "cpu")
    k_flash, _ = gather_blocks(kv, [0], "split_last")
    assert not torch.equal(k_cpu, k_flash)


def test_backend_names():
    assert layout_for_backend("CPU_ATTN") == "cpu"
    assert layout_for_backend("FLASH_ATTN") == "split_last"
    with pytest.raises(ValueError, match="FLASHINFER.*supported backends"):
        layout_for_backend("FLASHINFER")


def test_bad_arguments_leave_the_cache_untouched():
    kv = torch.randn(4, 2, 4, 8)
    before = kv.clone()
    k = torch.randn(2, 4, 2, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        scatter_blocks(kv, [0, 1], k, k, "nhd")
    with pytest.raises(ValueError, match=r"block_ids must be in \[0, 4\)"):
        scatter_blocks(kv, [0, 4], k, k, "split_last")
    with pytest.raises(ValueError, match="must not repeat"):
        scatter_blocks(kv, [1, 1], k, k, "split_last")
    with pytest.raises(ValueError, match="values must have shape"):
        scatter_blocks(kv, [0, 1], k, k[:, :2], "split_last")
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        scatter_blocks(kv, [0, 1], k.numpy(), k, "split_last")
    with pytest.raises(ValueError, match="rank|per-layer view"):
        gather_blocks(kv[0], [0], "cpu")
    with pytest.raises(ValueError, match="odd size"):
        gather_blocks(torch.randn(2, 2, 4, 7), [0], "split_last")
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(torch.randn(2, 4, 2, 8).transpose(1, 2), [0], "cpu")
    assert torch.equal(kv, before)
