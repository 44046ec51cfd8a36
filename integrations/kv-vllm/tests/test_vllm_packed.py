"""The packed-KV page format, open-block staging and paged attention (kv_vllm.packed), without vLLM.

The engine flow is simulated on a synthetic pool laid out as vLLM's CPU view (``[num_blocks, H, N, C]``, head-major
blocks): each step stages the new tokens, attends, then packs the blocks that became complete. The reference is
dense causal attention over the same keys and values, where every block completed *before* the step is replaced
by KIVI's quantize-dequantize of that block (kvcodec.UniformQuantizer directly).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from kv_vllm.packed import (
    ENV_BITS,
    ENV_GROUP,
    OpenBlocks,
    PackedKVConfig,
    PageFormat,
    check_layer,
    pack_complete,
    page_bytes_view,
    paged_attention,
)
from kvcodec.decode_v2 import OUT_RTOL
from kvcodec.uniform import UniformQuantizer

sys.path.insert(0, str(Path(__file__).parent))
from engine_flow import dense_reference, schedule


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_pack_unpack_is_kivi_quantize_dequantize(bits, dtype):
    torch.manual_seed(bits)
    fmt = PageFormat(32, 2, 64, dtype, bits, 32)
    k, v = (torch.randn(3, 2, 32, 64).to(dtype) for _ in range(2))
    pages = fmt.pack(k, v)
    assert pages.dtype == torch.uint8 and pages.shape == (3, 2, 32 * fmt.token_bytes)
    k2, v2 = fmt.unpack(pages)
    if bits == 16:
        assert torch.equal(k2, k) and torch.equal(v2, v)
        return
    keys = UniformQuantizer(bits, "channel", 32)  # per channel over the block's 32 tokens
    vals = UniformQuantizer(bits, "token", 32)  # per token in groups of 32 channels
    assert torch.equal(k2, keys.dequantize(keys.quantize(k)))
    assert torch.equal(v2, vals.dequantize(vals.quantize(v)))


@pytest.mark.parametrize(
    ("bits", "dtype", "ratio"),
    [(16, torch.float16, 1.0), (8, torch.float16, 1.778), (4, torch.float16, 3.2), (2, torch.float16, 5.333),
     (4, torch.bfloat16, 3.2), (2, torch.bfloat16, 5.333), (4, torch.float32, 5.333), (2, torch.float32, 8.0)],
)  # fmt: skip
def test_capacity_ratio_includes_metadata(bits, dtype, ratio):
    """Llama-3-8B-shaped layer (8 KV heads × 128, 32-token blocks): pages hold codes + scales + zeros."""
    fmt = PageFormat(32, 8, 128, dtype, bits, 32)
    e = torch.empty((), dtype=dtype).element_size()
    assert fmt.dense_page_bytes == 8 * 32 * 2 * 128 * e
    if bits != 16:
        codes = 2 * 32 * 128 * bits // 8
        meta = 2 * 128 * e + 2 * 32 * (128 // 32) * e  # key scale+zero per channel, value scale+zero per group
        assert fmt.content_bytes == codes + meta
    assert fmt.page_bytes == 8 * 32 * fmt.token_bytes >= 8 * fmt.content_bytes
    assert fmt.token_bytes % e == 0
    assert fmt.capacity_ratio == pytest.approx(ratio, abs=1e-3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 3}, "cannot pack 3-bit codes"),
        ({"bits": 1}, "cannot pack 1-bit codes"),
        ({"group_size": 48}, "head size 64 is not a multiple of the value group size 48"),
        ({"group_size": 0}, "must be an int >= 1"),
        ({"block_size": 8}, "block size 8 breaks the per-channel key groups"),
        ({"block_size": 24}, "block size 24 breaks"),
        ({"dtype": torch.float64}, "is not one of float16, bfloat16, float32"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, match):
    args = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16, "bits": 4, "group_size": 32}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match) as err:
        PageFormat(**args)
    assert "\n" not in str(err.value) and str(err.value).startswith("kvcompress packed KV")


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        (("MLAAttentionSpec", None, "NONE", 576, 576), "MLA layers"),
        (("SlidingWindowSpec", 4096, "NONE", 128, 128), "sliding-window"),
        (("FullAttentionSpec", 4096, "NONE", 128, 128), "sliding-window"),
        (("ChunkedLocalAttentionSpec", None, "NONE", 128, 128), "chunked-local"),
        (("CrossAttentionSpec", None, "NONE", 128, 128), "only FullAttentionSpec"),
        (("FullAttentionSpec", None, "FP8_PER_TENSOR", 128, 128), "quantized KV cache"),
        (("FullAttentionSpec", None, "NONE", 192, 128), "key/value head sizes"),
    ],
)
def test_unsupported_layers_are_refused_in_one_line(layer, match):
    check_layer("FullAttentionSpec", None, "NONE", 128, 128)  # the supported layer
    with pytest.raises(ValueError, match=match) as err:
        check_layer(*layer)
    assert "\n" not in str(err.value) and str(err.value).startswith("kvcompress packed KV")


def test_config_from_env():
    assert PackedKVConfig.from_env({}) is None
    assert PackedKVConfig.from_env({ENV_BITS: "2"}) == PackedKVConfig(2, 32)
    assert PackedKVConfig.from_env({ENV_BITS: "4", ENV_GROUP: "64"}) == PackedKVConfig(4, 64)
    for bad in ("3", "four", "32"):
        with pytest.raises(ValueError, match="must be one of"):
            PackedKVConfig.from_env({ENV_BITS: bad})
    with pytest.raises(ValueError, match=ENV_GROUP):
        PackedKVConfig.from_env({ENV_BITS: "4", ENV_GROUP: "x"})


def test_open_blocks_stage_reset_complete_and_trim():
    st = OpenBlocks(1, 4, 2, torch.float32)
    kv = torch.arange(12, dtype=torch.float32).reshape(6, 1, 2)
    st.write(kv, -kv, torch.tensor([8, 9, 10, 11, 12, -1]))  # block 2 full, block 3 one token, one padding token
    assert st.complete() == [2] and sorted(st.blocks) == [2, 3]
    k, v = st.get(2)
    assert torch.equal(k[0], kv[:4, 0]) and torch.equal(v[0], -kv[:4, 0])
    st.write(kv[:1] + 100, kv[:1], torch.tensor([8]))  # offset 0 again: a reused block id starts fresh
    assert st.complete() == [] and not bool(st.blocks[2][2][1:].any())
    st.write(kv[:1], kv[:1], torch.tensor([20]))  # block 5, most recent
    assert st.trim(2) == [3] and sorted(st.blocks) == [2, 5]
    with pytest.raises(KeyError, match="block 3 is open but its full-precision tokens were dropped"):
        st.get(3)
    assert st.nbytes == 2 * 2 * (1 * 4 * 2 * 4)


def test_page_bytes_view_writes_through_strided_layer_views():
    """Several layers in one tensor (blocks strided apart): the byte view writes into the layer's own blocks."""
    raw = torch.zeros(5, 2, 3, 2, 4, 6, dtype=torch.float16)  # [B, L, ..] -> layer 1 is strided
    layer = raw[:, 1].reshape(5, 3, 2, 4, 6)[:, 0]  # [B, H=2, N=4, C=6], blocks contiguous, strided apart
    pages = page_bytes_view(layer)
    assert pages.shape == (5, 2, 4 * 6 * 2)
    pages[3].fill_(0xFF)
    assert bool(torch.isnan(layer[3]).all()) and not bool(torch.isnan(layer[2]).any())
    assert not bool(torch.isnan(raw[:, 0]).any())


def kivi_roundtrip(k, v, fmt):
    """What a packed block reads back as: KIVI quantize-dequantize ([H, N, D] each)."""
    if fmt.bits == 16:
        return k, v
    qk = UniformQuantizer(fmt.bits, "channel", fmt.block_size)
    qv = UniformQuantizer(fmt.bits, "token", fmt.group_size)
    return qk.dequantize(qk.quantize(k)), qv.dequantize(qv.quantize(v))


@pytest.mark.parametrize("decode", ["torch", "v2"])
@pytest.mark.parametrize("bits", [16, 4, 2])
def test_engine_flow_matches_dense_attention_over_packed_history(bits, decode):
    """Chunked prefill + decode of 3 requests in one pool; request 2 shares request 0's first two packed blocks.

    The torch path (and every prefill chunk) equals the dense reference to float32 rounding; decode steps on the v2
    path (2/4 bits) are within docs/protocols.md's contract of it: float32 here, so read()'s entries are the float32
    dequantization and the allowance is OUT_RTOL per query row."""
    torch.manual_seed(0)
    N, H, Hq, D, dt = 16, 2, 4, 32, torch.float32
    fmt = PageFormat(N, H, D, dt, bits, 16)
    pool = torch.zeros(24, H, N, fmt.token_bytes // 4, dtype=dt)
    pages = page_bytes_view(pool)
    staged = OpenBlocks(H, N, D, dt)
    scale = 1 / math.sqrt(D)
    total = [45, 37, 40]
    tables = [[0, 1, 2, 3], [5, 6, 7], [0, 1, 9, 10]]  # request 2 reuses blocks 0, 1 (a prefix-cache hit)
    hist_k = [torch.randn(H, L, D) for L in total]
    hist_v = [torch.randn(H, L, D) for L in total]
    hist_k[2][:, : 2 * N], hist_v[2][:, : 2 * N] = hist_k[0][:, : 2 * N], hist_v[0][:, : 2 * N]
    done = [0, 0, 0]
    # request 2 starts once request 0's two shared blocks are packed, with 2N tokens computed (the cache hit)
    steps = [{0: 20, 1: 32}, {0: 20}, {0: 1, 1: 1}, {0: 1, 1: 1}] + [{0: 1, 1: 1, 2: 1}] * 3
    steps.insert(2, {2: 5})
    done[2] = 2 * N
    for step in steps:
        sch = schedule(step, done, hist_k, hist_v, tables, N, Hq, D, staged)
        reqs, qs, query, starts, lens, table = sch.reqs, sch.qs, sch.query, sch.starts, sch.lens, sch.table
        out = torch.zeros(query.shape[0], Hq * D)
        paged_attention(
            query, pages, staged, fmt, torch.tensor(starts), torch.tensor(lens), table, scale, out, decode=decode
        )
        for i, r in enumerate(reqs):
            ctx = done[r]
            n_packed = ctx // N
            keys, values = hist_k[r][:, : lens[i]].clone(), hist_v[r][:, : lens[i]].clone()
            for j in range(n_packed):
                sl = slice(j * N, (j + 1) * N)
                keys[:, sl], values[:, sl] = kivi_roundtrip(keys[:, sl], values[:, sl], fmt)
            q = qs[i].transpose(0, 1)
            want = dense_reference(q, keys, values, ctx, scale).transpose(0, 1).reshape(-1, Hq * D)
            if decode == "v2" and bits in (2, 4) and step[r] == 1:
                got = out[starts[i] : starts[i + 1]].view(Hq, D)
                rel = (got - want.view(Hq, D)).norm(dim=-1) / want.view(Hq, D).norm(dim=-1)
                assert float(rel.max()) <= OUT_RTOL, (step, r, float(rel.max()))
                continue
            torch.testing.assert_close(
                out[starts[i] : starts[i + 1]], want, atol=2e-5, rtol=1e-5, msg=lambda m, s=step, r=r: f"{s} r{r}: {m}"
            )
        pack_complete(fmt, staged, pages)
        for r in reqs:
            done[r] += step[r]
    assert done == total
    # every complete block was packed exactly once and left staging; open blocks remain staged
    assert sorted(staged.blocks) == [2, 7, 9]
    k0, _ = fmt.unpack(pages[:1])
    assert torch.equal(k0[0], kivi_roundtrip(hist_k[0][:, :N], hist_v[0][:, :N], fmt)[0])
