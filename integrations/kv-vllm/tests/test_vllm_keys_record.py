"""Cache keys (vLLM's block hashes under a namespace) and the per-block entry format."""

import sys
from pathlib import Path

import pytest

import kvpages
from kv_vllm import namespace, record, request_keys

sys.path.insert(0, str(Path(__file__).parent))
from block_hashing import block_hashes


def ns(**overrides):
    args = dict(model="m@", dtype="float16", num_kv_heads=2, head_size=64, block_size=4, codec_hash="0" * 32)
    args.update(overrides)
    return namespace(**args)


def keys_of(tokens, extra=None, n=None, **ns_overrides):
    hashes = block_hashes(tokens, 4, extra)
    return request_keys(ns(**ns_overrides), hashes, len(hashes) if n is None else n)


def test_keys_follow_the_engine_block_hash_chain():
    a = keys_of(list(range(12)))
    b = keys_of(list(range(8)) + [99, 9, 10, 11])
    assert len(a) == 3 and len(set(a)) == 3
    assert a[:2] == b[:2] and a[2] != b[2]  # same prefix, same keys; a changed block changes its key
    c = keys_of([7] + list(range(1, 12)))
    assert not set(a) & set(c)  # a change in block 0 changes every later key
    assert keys_of(list(range(14))) == a  # the partial tail block gets no key
    assert keys_of(list(range(12)), n=2) == a[:2]


@pytest.mark.parametrize("extra", ["lora:adapter-a", ("cache_salt", "tenant-1"), ("mm", "image-hash")])
def test_what_the_engine_folds_into_its_hash_keys_entries_apart(extra):
    """Same token ids, different LoRA / cache_salt / image behind the placeholders: no shared key."""
    tokens = list(range(12))
    assert not set(keys_of(tokens)) & set(keys_of(tokens, extra))
    assert keys_of(tokens, extra) == keys_of(tokens, extra)


def test_hashes_per_block_uses_the_hash_at_each_block_end():
    hashes = block_hashes(list(range(16)), 2)  # the engine hashes every 2 tokens, KV blocks hold 4
    by_two = request_keys(ns(), hashes, 4, hashes_per_block=2)
    assert by_two == request_keys(ns(), hashes[1::2], 4)


def test_a_request_without_enough_hashes_gets_no_keys():
    assert request_keys(ns(), [], 2) is None
    assert request_keys(ns(), block_hashes(list(range(8)), 4), 3) is None
    assert request_keys(ns(), [], 0) == []


@pytest.mark.parametrize(
    "field", [{"model": "other@"}, {"dtype": "bfloat16"}, {"num_kv_heads": 4}, {"codec_hash": "1" * 32}, {"tag": "x"}]
)
def test_every_namespace_field_changes_the_keys(field):
    assert not set(keys_of(list(range(8)))) & set(keys_of(list(range(8)), **field))


def test_namespace_and_keys_validate():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ns(num_kv_heads=0)
    with pytest.raises(TypeError, match="codec_hash must be a str"):
        ns(codec_hash=3)
    with pytest.raises(ValueError, match="tp_rank"):
        ns(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="num_blocks"):
        request_keys(ns(), [b"x"], -1)
    with pytest.raises(TypeError, match="block_hashes must be a sequence of bytes"):
        request_keys(ns(), b"abc", 1)
    with pytest.raises(TypeError, match=r"block_hashes\[0\] must be non-empty bytes"):
        request_keys(ns(), [17], 1)


H = kvpages.codec("lossless").config_hash()


def test_record_round_trip_and_damage():
    layers = {"model.layers.0.self_attn.attn": b"abc", "model.layers.1.self_attn.attn": b"\x00" * 10}
    entry = record.pack(layers, H)
    back = record.unpack(entry, H)
    assert {k: bytes(v) for k, v in back.items()} == layers
    for bad in (entry[:-1], entry[:10], entry[:40] + bytes([entry[40] ^ 1]) + entry[41:]):
        with pytest.raises(kvpages.CorruptEntry):
            record.unpack(bad, H)
    with pytest.raises(kvpages.CorruptEntry):  # written by another codec configuration
        record.unpack(entry, kvpages.codec("kivi-4").config_hash())
    with pytest.raises(ValueError, match="non-empty"):
        record.pack({}, H)
