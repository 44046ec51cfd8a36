"""PageCache metrics and corruption handling, chain_keys, framing."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import kvpages
from kvpages import CorruptEntry, PageCache, TieredStore, chain_keys, frame, unframe


def kv(seed=0, T=16, H=2, D=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, D, generator=g).to(dtype)


def test_page_cache_save_load_metrics():
    cache = PageCache(kvpages.codec("kivi-2"), TieredStore(cpu_bytes=1 << 20))
    k, v = kv()
    n = cache.save("p0", k, v)
    assert cache.exists("p0") and not cache.exists("p1")
    k2, _ = cache.load("p0")
    assert k2.shape == k.shape and cache.load("p1") is None
    m = cache.metrics
    assert (m.saves, m.hits, m.misses, m.stored_bytes, m.fp16_bytes) == (1, 1, 1, n, 2 * k.numel() * 2)
    assert m.compression == pytest.approx(m.fp16_bytes / n) and m.compression > 4
    assert m.encode_seconds > 0 and m.decode_seconds > 0


def test_a_page_the_store_refuses_is_not_counted_as_saved():
    cache = PageCache(kvpages.codec("lossless"), TieredStore(cpu_bytes=100))  # smaller than one page
    k, v = kv()
    assert cache.save("big", k, v) == 0 and not cache.exists("big")
    m = cache.metrics
    assert (m.saves, m.stored_bytes, m.fp16_bytes) == (0, 0, 0)
    assert cache.store.metrics.faults["fault_over_budget"] == 1


def test_two_codecs_share_a_store_without_mixing():
    store = TieredStore(cpu_bytes=1 << 20)
    a, b = PageCache(kvpages.codec("lossless"), store), PageCache(kvpages.codec("kivi-4"), store)
    k, v = kv(1)
    a.save("same", k, v)
    assert b.load("same") is None and not b.exists("same")
    assert torch.equal(a.load("same")[0], k)


def test_corrupt_blob_in_store_is_a_miss_and_deleted():
    store = TieredStore(cpu_bytes=1 << 20)
    cache = PageCache(kvpages.codec("lossless"), store)
    k, v = kv(2)
    cache.save("p", k, v)
    skey = cache.store_key("p")
    bad = bytearray(store.get(skey))
    bad[100] ^= 0xFF
    store.put(skey, bytes(bad))
    assert cache.load("p") is None
    assert cache.metrics.corrupt == 1 and not store.contains(skey)


def test_page_cache_rejects_wrong_types():
    with pytest.raises(TypeError, match="codec must be a kvpages.PageCodec"):
        PageCache("kivi-4", TieredStore(cpu_bytes=1))
    with pytest.raises(TypeError, match="store must be"):
        PageCache(kvpages.codec("int8"), {})


NS = {"model": "m", "dtype": "float16", "layout": "thd", "codec": "c"}


@settings(max_examples=30, deadline=None)
@given(blocks=st.lists(st.lists(st.integers(0, 2**31), min_size=1, max_size=8), min_size=1, max_size=5))
def test_chain_keys_prefix_property(blocks):
    """Invariant: key i depends on blocks 0..i only; changing any earlier block or the namespace changes it."""
    keys = chain_keys(NS, blocks)
    assert len(keys) == len(blocks) and len(set(keys)) == len(keys)
    assert chain_keys(NS, blocks[:1]) == keys[:1]
    assert chain_keys(dict(reversed(NS.items())), blocks) == keys  # order of the namespace does not matter
    changed = [list(b) for b in blocks]
    changed[0][0] += 1
    assert all(a != b for a, b in zip(chain_keys(NS, changed), keys))
    assert all(a != b for a, b in zip(chain_keys({**NS, "codec": "other"}, blocks), keys))


def test_chain_keys_block_boundaries_matter():
    assert chain_keys(NS, [[1, 2], [3]])[-1] != chain_keys(NS, [[1], [2, 3]])[-1]


def test_chain_keys_bad_input():
    with pytest.raises(TypeError, match="namespace"):
        chain_keys({"model": 1}, [[1]])
    with pytest.raises(TypeError, match="token_blocks\\[0\\] must hold ints"):
        chain_keys(NS, [[1.5]])
    with pytest.raises(ValueError, match="int64"):
        chain_keys(NS, [[2**70]])
    with pytest.raises(TypeError, match="token_blocks"):
        chain_keys(NS, "abc")


H = "0" * 32


@settings(max_examples=30, deadline=None)
@given(payload=st.binary(max_size=300), cut=st.integers(0, 400), flip=st.integers(0, 400))
def test_frame_round_trip_and_any_damage_detected(payload, cut, flip):
    """Invariant: unframe(frame(p)) == p; any truncation or single-bit flip raises CorruptEntry."""
    blob = frame(payload, H)
    assert bytes(unframe(blob, H)) == payload
    if cut < len(blob):
        with pytest.raises(CorruptEntry):
            unframe(blob[:cut])
    bad = bytearray(blob)
    bad[flip % len(blob)] ^= 1 << (flip % 8)
    with pytest.raises(CorruptEntry):
        unframe(bytes(bad))


def test_frame_bad_arguments():
    with pytest.raises(ValueError, match="codec_hash must be 32 hex digits"):
        frame(b"x", "abc")
    with pytest.raises(TypeError, match="payload must be bytes"):
        frame("x", H)
    with pytest.raises(CorruptEntry, match="expected codec"):
        unframe(frame(b"x", H), "1" * 32)
