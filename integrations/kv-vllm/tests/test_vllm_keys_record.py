"""Cache keys (block hash chain under a namespace) and the per-block entry format."""

import pytest

import kvpages
from kv_vllm import block_keys, namespace, record


def ns(**overrides):
    args = dict(model="m@", dtype="float16", num_kv_heads=2, head_size=64, block_size=4, codec_hash="0" * 32)
    args.update(overrides)
    return namespace(**args)


def test_keys_are_a_prefix_chain():
    a = block_keys(ns(), list(range(12)), 4)
    b = block_keys(ns(), list(range(8)) + [99, 9, 10, 11], 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert a[:2] == b[:2] and a[2] != b[2]  # same prefix, same keys; a changed block changes its key
    c = block_keys(ns(), [7] + list(range(1, 12)), 4)
    assert not set(a) & set(c)  # a change in block 0 changes every later key
    assert block_keys(ns(), list(range(14)), 4) == a  # the partial tail block gets no key
    assert block_keys(ns(), list(range(12)), 4, num_blocks=2) == a[:2]


@pytest.mark.parametrize(
    "field", [{"model": "other@"}, {"dtype": "bfloat16"}, {"num_kv_heads": 4}, {"codec_hash": "1" * 32}, {"tag": "x"}]
)
def test_every_namespace_field_changes_the_keys(field):
    assert not set(block_keys(ns(), list(range(8)), 4)) & set(block_keys(ns(**field), list(range(8)), 4))


def test_namespace_validates():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ns(num_kv_heads=0)
    with pytest.raises(TypeError, match="codec_hash must be a str"):
        ns(codec_hash=3)
    with pytest.raises(ValueError, match="tp_rank"):
        ns(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="num_blocks"):
        block_keys(ns(), list(range(8)), 4, num_blocks=3)


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
