"""Method tiers in vLLM's pool (``KVCOMPRESS_KV_CODEC``, kv_vllm.packed.CodecPageFormat), without vLLM.

A registered ``kvpages`` codec (kv-hqekv's ``hqekv-*``, kv-hex's ``hex-*`` / ``kcvt-*``, found by name through the
registry) holds each complete block. The engine flow is simulated on a synthetic pool laid out as vLLM's CPU view,
as in test_vllm_packed.py; the reference is dense causal attention where every block packed *before* the step is
replaced by ``codec.decode`` of the bytes the pool holds for it.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

import kvpages
from kv_vllm.packed import (
    ENV_BITS,
    ENV_CODEC,
    ENV_GROUP,
    CodecPageFormat,
    OpenBlocks,
    PackedKVConfig,
    PageFormat,
    pack_complete,
    page_bytes_view,
    page_format_for,
    paged_attention,
    pool_codec_names,
)

sys.path.insert(0, str(Path(__file__).parent))
from engine_flow import dense_reference, schedule

METHOD_CODECS = ["hqekv-2", "hqekv-2.8", "hqekv-3.2", "hqekv-3.25", "hex-3", "hex-4", "kcvt-3", "kcvt-4"]
SHAPES = [(32, 2, 64, torch.float32), (32, 8, 128, torch.float16), (64, 8, 128, torch.bfloat16)]


def blob_of(pages: torch.Tensor, block: int) -> bytes:
    raw = pages[block].reshape(-1).numpy().tobytes()
    return raw[: kvpages.frame_length(raw)]


@pytest.mark.parametrize("name", METHOD_CODECS)
@pytest.mark.parametrize(("N", "H", "D", "dtype"), SHAPES)
def test_page_size_is_the_codecs_declared_size(name, N, H, D, dtype):
    """vLLM's bytes per (head, token) come from ``max_encoded_bytes``; every blob fits, no more than one element
    per (head, token) of padding."""
    fmt = CodecPageFormat(N, H, D, dtype, name)
    declared = kvpages.codec(name).max_encoded_bytes(N, H, D, dtype)
    e = torch.empty((), dtype=dtype).element_size()
    assert fmt.token_bytes % e == 0 and fmt.token_bytes == math.ceil(declared / (H * N) / e) * e
    assert declared <= fmt.page_bytes < declared + H * N * e
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, H, N, D, generator=g).to(dtype), torch.randn(2, H, N, D, generator=g).to(dtype)
    pages = fmt.pack(k, v)
    assert pages.shape == (2, H, N * fmt.token_bytes)
    for b in range(2):
        assert len(blob_of(pages, b)) == declared  # HEX and HqeKV: the size is fixed by the shape


@pytest.mark.parametrize("name", METHOD_CODECS)
def test_pool_holds_more_blocks_than_16_bit(name, capsys):
    """At a fixed KV budget (1 GiB) a Llama-3-8B-shaped layer (8 KV heads x 128, 32- and 64-token blocks, fp16)
    holds ``dense / page`` times the stock blocks."""
    budget = 1 << 30
    with capsys.disabled():
        for N in (32, 64):
            fmt = CodecPageFormat(N, 8, 128, torch.float16, name)
            stock, ours = budget // fmt.dense_page_bytes, budget // fmt.page_bytes
            assert ours > stock and ours / stock == pytest.approx(fmt.capacity_ratio, rel=1e-3)
            print(
                f"\n{name} N={N}: {fmt.page_bytes} B/block ({fmt.token_bytes} B per head and token vs 512), "
                f"{ours} vs {stock} blocks per GiB: {ours / stock:.2f}x"
            )


@pytest.mark.parametrize(("name", "N"), [("hqekv-2", 16), ("hqekv-3.25", 32), ("hex-3", 64), ("kcvt-4", 16)])
def test_engine_flow_matches_attention_over_decoded_blocks(name, N):
    """Chunked prefill + decode of 3 requests; request 2 shares request 0's first two packed blocks.

    Each step equals dense attention over (codec.decode of the pool's packed blocks) + the staged tokens at full
    precision; each packed block is exactly ``codec.encode`` of its tokens with the importance staged for it (the
    queries of its own block); the shared blocks are never rewritten."""
    torch.manual_seed(0)
    H, Hq, D, dt = 2, 4, 64, torch.float32
    fmt = page_format_for(PackedKVConfig(codec=name), N, H, D, dt)
    codec = kvpages.codec(name)
    assert isinstance(fmt, CodecPageFormat) and fmt.wants_importance
    pool = torch.zeros(24, H, N, fmt.token_bytes // 4, dtype=dt)
    pages = page_bytes_view(pool)
    staged = OpenBlocks(H, N, D, dt, track_importance=True)
    scale = 1 / math.sqrt(D)
    total = [N * 2 + 13, N * 2 + 5, N * 2 + 8]
    tables = [[0, 1, 2, 3], [5, 6, 7], [0, 1, 9, 10]]
    hist_k = [torch.randn(H, L, D) for L in total]
    hist_v = [torch.randn(H, L, D) for L in total]
    hist_k[2][:, : 2 * N], hist_v[2][:, : 2 * N] = hist_k[0][:, : 2 * N], hist_v[0][:, : 2 * N]
    done = [0, 0, 0]
    half = N + N // 4
    steps = [{0: half, 1: 2 * N}, {0: 2 * N + 8 - half}, {2: 5}, {0: 1, 1: 1}, {0: 1, 1: 1}]
    steps += [{0: 1, 1: 1, 2: 1}] * 3
    done[2] = 2 * N
    encoded: dict[int, bytes] = {}
    for step in steps:
        sch = schedule(step, done, hist_k, hist_v, tables, N, Hq, D, staged)
        reqs, qs, query, starts, lens, table = sch.reqs, sch.qs, sch.query, sch.starts, sch.lens, sch.table
        out = torch.zeros(query.shape[0], Hq * D)
        paged_attention(query, pages, staged, fmt, torch.tensor(starts), torch.tensor(lens), table, scale, out)
        for i, r in enumerate(reqs):
            ctx = done[r]
            keys, values = hist_k[r][:, : lens[i]].clone(), hist_v[r][:, : lens[i]].clone()
            for j in range(ctx // N):
                dk, dv = codec.decode(blob_of(pages, tables[r][j]))  # [N, H, D]
                keys[:, j * N : (j + 1) * N], values[:, j * N : (j + 1) * N] = dk.transpose(0, 1), dv.transpose(0, 1)
            want = dense_reference(qs[i].transpose(0, 1), keys, values, ctx, scale).transpose(0, 1)
            torch.testing.assert_close(out[starts[i] : starts[i + 1]], want.reshape(-1, Hq * D), atol=2e-5, rtol=1e-5)
        # what pack_complete must write: codec.encode of each complete block with its staged importance
        for blk in staged.complete():
            k, v = staged.get(blk)
            imp = staged.importance(blk).clone()
            assert bool((imp > 0).all())  # every token draws attention from its own query at least
            encoded[blk] = codec.encode(k.transpose(0, 1), v.transpose(0, 1), importance=imp)
        want_packed = sorted(staged.complete())
        before = {b: pages[b].clone() for b in encoded if b not in want_packed}
        packed = pack_complete(fmt, staged, pages)
        assert sorted(packed) == want_packed
        for b in packed:
            assert blob_of(pages, b) == encoded[b]
        for b, old in before.items():
            assert torch.equal(pages[b], old)  # a packed (shared) block is never written again
        for r in reqs:
            done[r] += step[r]
    assert done == total
    assert sorted(encoded) == [0, 1, 5, 6]  # block 0 and 1 packed once (by request 0), not again for request 2
    assert sorted(staged.blocks) == [2, 7, 9]


def test_importance_is_the_attention_of_the_blocks_own_queries():
    """A 2-block prefill: block j's importance is the causal softmax mass that queries at positions in block j
    put on each of its tokens, summed over each KV head's query heads (GQA group 2)."""
    torch.manual_seed(1)
    N, H, Hq, D = 16, 2, 4, 32
    L = 2 * N + 3
    fmt = CodecPageFormat(N, H, D, torch.float32, "hqekv-2")
    staged = OpenBlocks(H, N, D, torch.float32, track_importance=True)
    pages = torch.zeros(4, H, N * fmt.token_bytes, dtype=torch.uint8)
    k, v, q = torch.randn(L, H, D), torch.randn(L, H, D), torch.randn(L, Hq, D)
    staged.write(k, v, torch.arange(L))
    out = torch.zeros(L, Hq, D)
    scale = 0.2
    paged_attention(q, pages, staged, fmt, torch.tensor([0, L]), torch.tensor([L]), torch.tensor([[0, 1, 2]]),
                    scale, out)  # fmt: skip
    logits = q.transpose(0, 1) @ k.transpose(0, 1).repeat_interleave(2, 0).transpose(-1, -2) * scale
    p = torch.softmax(logits.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf")), -1)  # [Hq, L, L]
    for j in range(2):
        sl = slice(j * N, (j + 1) * N)
        want = p[:, sl, sl].sum(1).view(H, 2, N).sum(1).transpose(0, 1)  # [N, H]
        torch.testing.assert_close(staged.importance(j), want, atol=1e-5, rtol=1e-5)
    assert pack_complete(fmt, staged, pages) == [0, 1]


def test_codec_without_importance_keeps_its_own_ranking():
    """The built-in kivi-4 does not accept an importance: blocks are packed with its own encode, nothing tracked."""
    fmt = CodecPageFormat(32, 2, 64, torch.float16, "kivi-4")
    assert not fmt.wants_importance
    staged = OpenBlocks(2, 32, 64, torch.float16)
    k, v = torch.randn(32, 2, 64).half(), torch.randn(32, 2, 64).half()
    staged.write(k, v, torch.arange(32) + 32)
    pages = torch.zeros(3, 2, 32 * fmt.token_bytes, dtype=torch.uint8)
    assert pack_complete(fmt, staged, pages) == [1]
    assert blob_of(pages, 1) == kvpages.codec("kivi-4").encode(k, v)
    k2, _ = fmt.unpack(pages[1:2])
    torch.testing.assert_close(k2[0].transpose(0, 1), kvpages.codec("kivi-4").decode(blob_of(pages, 1))[0])


def test_config_from_env_with_a_codec():
    assert PackedKVConfig.from_env({ENV_CODEC: "hqekv-2"}) == PackedKVConfig(codec="hqekv-2")
    assert PackedKVConfig.from_env({ENV_CODEC: "  hex-3 "}).codec == "hex-3"
    names = pool_codec_names()
    assert {"hqekv-2", "hex-3", "kivi-4", "lossless"} <= set(names)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({ENV_CODEC: "snapkv"}, r"KVCOMPRESS_KV_CODEC='snapkv' is not a registered codec .*; available: .*hex-3"),
        ({ENV_CODEC: "hex-3", ENV_BITS: "4"}, r"set either KVCOMPRESS_KV_BITS .* or KVCOMPRESS_KV_CODEC .*, not both"),
        ({ENV_CODEC: "hqekv-2", ENV_GROUP: "64"}, r"set either .* not both"),
    ],
)
def test_bad_codec_settings_are_refused_in_one_line(env, match):
    with pytest.raises(ValueError, match=match) as info:
        PackedKVConfig.from_env(env)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("block", [8, 24, 40])
def test_incompatible_block_size_is_refused_in_one_line(block):
    with pytest.raises(ValueError, match=f"block size {block} does not fit codec 'hex-3'; use a multiple of 16") as i:
        page_format_for(PackedKVConfig(codec="hex-3"), block, 2, 64, torch.float16)
    assert "\n" not in str(i.value)


def test_uniform_bits_still_give_a_kivi_page_format():
    assert isinstance(page_format_for(PackedKVConfig(4, 32), 32, 2, 64, torch.float16), PageFormat)
