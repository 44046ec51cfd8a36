"""Checks against SGLang's real HiCacheStorage, HiCacheStorageConfig and StorageBackendFactory (run by test_engine).

The host pools here are synthetic: SGLang's ``MHATokenToKVPoolHost`` cannot be built on CPU without the CUDA
pieces its module imports (torchvision via sglang.srt.configs), so ``SyntheticHostPool`` holds a ``kv_buffer`` of
each documented layout and reproduces ``get_data_page`` / ``get_dummy_flat_data_page`` / ``set_from_flat_data_page``
of SGLang 0.5.23 (``mem_cache/pool_host/mha.py``).
"""

import ast
import dataclasses
import errno
import hashlib
import importlib.util
import io
import logging
import os
import pathlib
import random
import sys
import types
import typing

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import kvpages
from kv_sglang import KVCompressStorage

L, P, H, D = 2, 16, 2, 64
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class SyntheticHostPool:
    def __init__(self, layout, pages=4, dtype=torch.float16, seed=0):
        self.layout, self.layer_num, self.page_size, self.head_num = layout, L, P, H
        self.head_dim = self.v_head_dim = D
        self.dtype, self.size = dtype, pages * P
        g = torch.Generator().manual_seed(seed)
        dims = {
            "layer_first": (2, L, self.size, H, D),
            "page_first": (2, self.size, L, H, D),
            "page_first_direct": (2, pages, L, P, H, D),
        }[layout]
        self.kv_buffer = torch.randn(dims, generator=g).to(dtype)

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + P]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + P]
        else:
            page = self.kv_buffer[:, index // P : index // P + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, L, P, H, D), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + P] = data_page.reshape(2, L, P, H, D)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + P] = data_page.reshape(2, P, L, H, D)
        else:
            self.kv_buffer[:, index // P : index // P + 1] = data_page.reshape(2, 1, L, P, H, D)

    def page_kv(self, index):
        """Keys and values of a page as [layers, tokens, heads, dim], whatever the layout."""
        x = self.get_data_page(index, flat=False)
        x = x.reshape((2, P, L, H, D) if self.layout == "page_first" else (2, L, P, H, D))
        return x.transpose(1, 2) if self.layout == "page_first" else x


def config(tp_rank=0, tp_size=1, storage_metrics=False, **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=storage_metrics,
        is_page_first_layout=False,
        model_name="tiny-llama",
        extra_config={
            "backend_name": "kvcompress",
            "module_path": "kv_sglang",
            "class_name": "KVCompressStorage",
            **extra,
        },
    )


def backend(pool=None, tp_rank=0, tp_size=1, storage_metrics=False, **extra):
    cfg = config(tp_rank, tp_size, storage_metrics, **extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    if pool is not None:
        b.register_mem_pool_host(pool)  # what SGLang's cache controller does right after creation
    return b


def test_factory_creates_our_backend_from_the_dynamic_config():
    b = backend(codec="kivi-4", cpu_bytes=1 << 20)
    assert isinstance(b, KVCompressStorage) and isinstance(b, HiCacheStorage)
    assert b.settings.codec == "kivi-4" and b.cache.store.cpu_budget == 1 << 20


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"codec": "kivi-3"}, ValueError, "unknown codec 'kivi-3'; available"),
        ({"cpu_bytes": -1}, ValueError, "cpu_bytes must be an int >= 0"),
        ({"cpu_bytes": "1G"}, TypeError, "cpu_bytes"),
        ({"disk_dir": "/nonexistent/kv"}, ValueError, "does not exist"),
        ({"disk_bytes": 10}, ValueError, "disk_bytes needs disk_dir"),
        ({"cpu_byte": 10}, ValueError, "unknown kv_sglang config keys"),
        ({"codec": "kivi-4", "codec_options": {"bits": 3}}, ValueError, "invalid options"),
    ],
)
def test_bad_config_fails_at_creation(extra, error, match):
    with pytest.raises(error, match=match):
        backend(**extra)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_round_trip_lossless_is_bit_exact(layout):
    pool = SyntheticHostPool(layout)
    b = backend(pool, codec="lossless")
    keys = [f"h{i}" for i in range(4)]
    assert b.batch_set(keys, [pool.get_data_page(i * P) for i in range(4)])
    pages = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    other = SyntheticHostPool(layout, seed=1)
    for i, page in enumerate(pages):
        other.set_from_flat_data_page(i * P, page)
    assert torch.equal(other.kv_buffer, pool.kv_buffer)


def kivi4_bound(x):
    """|error| bound of kivi-4 for x [2, L, P, H, D]: keys per (layer, head, channel) over the page's tokens, values
    per token in groups of 32 channels; scale/2 with scale = range / 15, plus 1% for the scale's own rounding and the
    fp16 rounding of the output."""
    x = x.float()
    k, v = x[0], x[1]
    sk = (k.amax(1, keepdim=True) - k.amin(1, keepdim=True)) / 15
    vg = v.reshape(L, P, H, D // 32, 32)
    sv = ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / 15).expand_as(vg).reshape(L, P, H, D)
    return torch.stack([sk.expand_as(k), sv]) / 2 * 1.01 + x.abs() * 2**-10


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_lossless_exact_and_kivi4_bounded(layout):
    for codec in ("lossless", "kivi-4"):
        pool = SyntheticHostPool(layout)
        original = pool.kv_buffer.clone()
        b = backend(pool, codec=codec, interface_v1=1)
        keys = ["a", "b", "c"]
        host = torch.arange(P, 4 * P)  # pages 1..3
        assert b.batch_set_v1(keys, host) == [True] * 3
        pool.kv_buffer.zero_()
        assert b.batch_get_v1(keys, host) == [True] * 3
        ref = SyntheticHostPool(layout)  # same seed: the original values
        for i in range(1, 4):
            got, want = pool.page_kv(i * P), ref.page_kv(i * P)
            if codec == "lossless":
                assert torch.equal(got, want)
            else:
                err = (got.float() - want.float()).abs()
                assert bool((err <= kivi4_bound(want)).all()), float(err.max())
                assert float(err.max()) > 0  # it is lossy
        assert torch.count_nonzero(pool.page_kv(0)) == 0  # page 0 was not asked for and stays untouched
        assert original.shape == pool.kv_buffer.shape


def test_pages_are_layout_free():
    """A page written from a page_first pool loads bit-exact into a layer_first pool (same geometry)."""
    src, dst = SyntheticHostPool("page_first"), SyntheticHostPool("layer_first", seed=5)
    b_src = backend(src, codec="lossless", cpu_bytes=1 << 20)
    b_dst = KVCompressStorage(config(codec="lossless"), {})
    b_dst.cache = b_src.cache  # one store shared by two host pools
    b_dst.register_mem_pool_host(dst)
    b_src.batch_set_v1(["x"], torch.arange(P))
    assert b_dst.batch_get_v1(["x"], torch.arange(2 * P, 3 * P)) == [True]
    assert torch.equal(dst.page_kv(2 * P), src.page_kv(0))


def test_exists_and_batch_exists_leading_run():
    pool = SyntheticHostPool("layer_first")
    b = backend(pool)
    b.set("k0", pool.get_data_page(0))
    b.set("k2", pool.get_data_page(2 * P))
    assert b.exists("k0") and not b.exists("k1") and b.exists("k2")
    assert b.batch_exists(["k0", "k1", "k2"]) == 1
    assert b.batch_exists(["k1", "k0"]) == 0
    b.set("k1", pool.get_data_page(P))
    assert b.batch_exists(["k0", "k1", "k2", "k3"]) == 3
    assert b.get("k3", pool.get_dummy_flat_data_page()) is None


def test_codec_is_part_of_the_key():
    pool = SyntheticHostPool("page_first")
    lossless = backend(pool, codec="lossless")
    lossy = backend(pool, codec="kivi-2")
    lossy.cache = type(lossy.cache)(lossy.cache.codec, lossless.cache.store)  # same store, other codec
    lossless.set("k", pool.get_data_page(0))
    assert not lossy.exists("k") and lossy.get("k") is None


def test_corrupt_disk_page_is_a_miss(tmp_path):
    pool = SyntheticHostPool("page_first_direct")
    b = backend(pool, codec="kivi-4", cpu_bytes=0, disk_dir=str(tmp_path))
    assert b.batch_set_v1(["p0", "p1"], torch.arange(2 * P)) == [True, True]
    files = sorted(tmp_path.glob("*.kvp"))
    assert len(files) == 2
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    before = pool.kv_buffer.clone()
    assert b.batch_get_v1(["p0", "p1"], torch.arange(2 * P)) == [False, False]
    assert torch.equal(pool.kv_buffer, before)  # a miss writes nothing
    m = b.metrics()
    assert m["store_corrupt"] == 2 and m["fault_corrupt"] == 2 and m["failed_loads_store"] == 2
    assert m["misses"] == 2 and m["hits"] == 0 and not b.exists("p0")


def test_budget_eviction():
    pool = SyntheticHostPool("layer_first", pages=4)
    page_blob = len(backend(pool, codec="kivi-2").cache.codec.encode(*pool_kv(pool, 0)))
    b = backend(pool, codec="kivi-2", cpu_bytes=2 * page_blob)
    for i in range(4):
        assert b.set(f"k{i}", pool.get_data_page(i * P))
    assert [b.exists(f"k{i}") for i in range(4)] == [False, False, True, True]
    stats = b.metrics()
    assert stats["store_evictions"] == 2 and stats["store_cpu_bytes"] <= 2 * page_blob
    assert stats["fp16_bytes"] / stats["stored_bytes"] > 4  # kivi-2 on 16-token pages (key scales per 16 tokens)
    assert stats["bytes_saved"] == stats["fp16_bytes"] - stats["stored_bytes"] > 0
    assert stats["stored_pages"] == 4 and stats["stored_bytes"] == 4 * page_blob


def pool_kv(pool, index):
    from kv_sglang import PageGeometry

    return PageGeometry.of_pool(pool).to_kv(pool.get_data_page(index))


# ------------------------------------------------------------------------------------------------ fault injection
# Every check below drives the backend SGLang's factory built and states what must hold: no exception reaches the
# caller, every load returns the exact page (lossless) or reports a miss and leaves the target page untouched, and
# the counters say what happened.


def disk_backend(tmp_path, pool, **extra):
    """A lossless backend whose pages all live on disk (cpu_bytes 0), so every load reads a file."""
    return backend(pool, codec="lossless", cpu_bytes=0, disk_dir=str(tmp_path), interface_v1=1, **extra)


def host(*pages):
    """host_indices of the given host pages."""
    return torch.cat([torch.arange(i * P, (i + 1) * P) for i in pages])


def files_of(tmp_path):
    return sorted(tmp_path.glob("*.kvp"))


def enospc_fdopen(real):
    """``os.fdopen`` whose files opened for writing fail every write with ENOSPC (a full disk)."""

    class FullDisk(io.RawIOBase):
        def __init__(self, fd):
            self._f = real(fd, "wb")

        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self._f.close()
            super().close()

    def fake(fd, mode="r", *args, **kwargs):
        return FullDisk(fd) if "w" in mode or "a" in mode else real(fd, mode, *args, **kwargs)

    return fake


def eio_read_bytes(self):
    """``pathlib.Path.read_bytes`` of a failing disk."""
    raise OSError(errno.EIO, "Input/output error")


def test_full_disk_is_not_stored_then_recovers(tmp_path, monkeypatch):
    pool = SyntheticHostPool("page_first")
    b = disk_backend(tmp_path, pool)
    monkeypatch.setattr(os, "fdopen", enospc_fdopen(os.fdopen))
    assert b.batch_set_v1(["a", "b"], host(0, 1)) == [False, False]
    assert b.set("c", pool.get_data_page(2 * P)) is False
    assert b.batch_set(["d"], [pool.get_data_page(3 * P)]) is False
    monkeypatch.undo()
    m = b.metrics()
    assert m["not_stored_store"] == 4 and m["fault_disk_full"] == 4 and m["stored_pages"] == 0
    assert files_of(tmp_path) == [] and not list(tmp_path.glob(".tmp-*"))  # no partial file left behind
    assert b.batch_exists(["a", "b"]) == 0
    before = pool.kv_buffer.clone()
    assert b.batch_get_v1(["a", "b"], host(2, 3)) == [False, False]
    assert torch.equal(pool.kv_buffer, before)
    assert b.batch_set_v1(["a"], host(0)) == [True]  # the disk has room again: stored
    assert b.batch_get_v1(["a"], host(3)) == [True] and torch.equal(pool.page_kv(3 * P), pool.page_kv(0))


def test_tiny_disk_budget_refuses_pages(tmp_path):
    pool = SyntheticHostPool("layer_first")
    b = disk_backend(tmp_path, pool, disk_bytes=100)  # smaller than one page
    assert b.batch_set_v1(["a"], host(0)) == [False]
    m = b.metrics()
    assert m["not_stored_store"] == 1 and m["fault_over_budget"] == 1 and m["store_rejected"] == 1
    assert b.batch_exists(["a"]) == 0 and b.get("a", pool.get_dummy_flat_data_page()) is None
    assert b.metrics()["failed_loads_absent"] == 1


def test_spill_to_a_full_disk_evicts_instead(tmp_path, monkeypatch):
    """CPU tier of one page over a full disk: the older page is evicted (a later miss), the newer one is served."""
    pool = SyntheticHostPool("page_first_direct")
    one = len(backend(pool).cache.codec.encode(*pool_kv(pool, 0)))
    b = backend(pool, codec="lossless", cpu_bytes=one, disk_dir=str(tmp_path))
    monkeypatch.setattr(os, "fdopen", enospc_fdopen(os.fdopen))
    assert b.batch_set_v1(["a", "b"], host(0, 1)) == [True, True]  # both held when set; "a" is evicted by "b"
    monkeypatch.undo()
    assert b.batch_exists(["a", "b"]) == 0 and b.exists("b")
    assert b.batch_get_v1(["a", "b"], host(2, 3)) == [False, True]
    assert torch.equal(pool.page_kv(3 * P), pool.page_kv(P))
    assert b.metrics()["fault_disk_full"] == 1 and b.metrics()["store_evictions"] == 1


def test_files_deleted_under_a_live_backend(tmp_path):
    pool = SyntheticHostPool("page_first")
    b = disk_backend(tmp_path, pool)
    assert b.batch_set_v1(["a", "b", "c"], host(0, 1, 2)) == [True] * 3
    files = {f.name: f for f in files_of(tmp_path)}
    assert len(files) == 3
    gone = next(f for f in files.values() if b._key("b").encode() in f.read_bytes())
    gone.unlink()  # by hand: the store's index still lists it until a load finds it gone
    pool3 = pool.page_kv(3 * P).clone()
    assert b.batch_get_v1(["a", "b", "c"], host(0, 3, 2)) == [True, False, True]
    assert torch.equal(pool.page_kv(3 * P), pool3)  # the missed page's target is untouched
    m = b.metrics()
    assert m["failed_loads_store"] == 1 and m["fault_vanished"] == 1 and m["hits"] == 2
    assert b.batch_exists(["a", "b", "c"]) == 1  # the lookup now tells the truth
    for f in files_of(tmp_path):
        f.unlink()
    assert b.batch_get_v1(["a", "c"], host(0, 2)) == [False, False] and b.batch_exists(["a"]) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_files_corrupted_under_a_live_backend(tmp_path, damage):
    pool = SyntheticHostPool("layer_first")
    b = disk_backend(tmp_path, pool)
    assert b.batch_set_v1(["a", "b"], host(0, 1)) == [True, True]
    for f in files_of(tmp_path):
        data = bytearray(f.read_bytes())
        if damage == "flip":
            data[-40] ^= 0x01
        f.write_bytes(bytes(data[: len(data) // 2] if damage == "truncate" else b"" if damage == "empty" else data))
    before = pool.kv_buffer.clone()
    assert b.batch_get_v1(["a", "b"], host(2, 3)) == [False, False]
    assert torch.equal(pool.kv_buffer, before)
    m = b.metrics()
    assert m["failed_loads_store"] == 2 and m["fault_corrupt"] == 2 and m["misses"] == 2
    assert files_of(tmp_path) == [] and b.batch_exists(["a", "b"]) == 0  # dropped, not offered again


def test_a_bad_blob_under_our_key_is_a_codec_corrupt_miss(tmp_path):
    """Another writer (another kvpages version, a bug) leaves a well-formed file whose blob is not a page frame."""
    pool = SyntheticHostPool("page_first")
    b = disk_backend(tmp_path, pool)
    assert b.batch_set_v1(["a"], host(0)) == [True]
    other = kvpages.TieredStore(0, tmp_path)
    assert other.put(b._key("a"), b"not a page frame")
    before = pool.kv_buffer.clone()
    assert b.batch_get_v1(["a"], host(1)) == [False] and torch.equal(pool.kv_buffer, before)
    m = b.metrics()
    assert m["failed_loads_corrupt"] == 1 and m["fault_corrupt"] == 1 and m["store_fault_corrupt"] == 0
    assert not b.exists("a") and files_of(tmp_path) == []  # the bad entry was deleted


def test_read_error_is_a_miss(tmp_path, monkeypatch):
    pool = SyntheticHostPool("page_first_direct")
    b = disk_backend(tmp_path, pool)
    assert b.batch_set_v1(["a", "b"], host(0, 1)) == [True, True]

    monkeypatch.setattr(pathlib.Path, "read_bytes", eio_read_bytes)
    before = pool.kv_buffer.clone()
    assert b.batch_get_v1(["a", "b"], host(2, 3)) == [False, False]
    assert b.get("a") is None  # the flat interface too (already dropped: absent)
    monkeypatch.undo()
    assert torch.equal(pool.kv_buffer, before)
    m = b.metrics()
    assert m["fault_io_error"] == 2 and m["failed_loads_store"] == 2 and m["failed_loads_absent"] == 1
    assert b.batch_exists(["a", "b"]) == 0  # unreadable entries are not offered again


def test_nonfinite_page_with_a_lossy_codec_is_not_stored(caplog):
    pool = SyntheticHostPool("page_first", pages=4)
    pool.kv_buffer[0, 0, 0, 0, 0] = float("nan")  # token 0 of page 0
    pool.kv_buffer[1, P, 1, 1, 3] = float("inf")  # token 0 of page 1 (values)
    b = backend(pool, codec="kivi-4", interface_v1=1)
    with caplog.at_level(logging.DEBUG, logger="kv_sglang.storage"):
        assert b.batch_set_v1(["a", "b", "c"], host(0, 1, 2)) == [False, False, True]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "nonfinite" in r.getMessage()]
    assert len(warnings) == 1  # logged once per kind; the second at debug level
    m = b.metrics()
    assert m["not_stored_nonfinite"] == 2 and m["fault_nonfinite"] == 2 and m["stored_pages"] == 1
    before = pool.kv_buffer.clone()
    assert b.batch_exists(["a"]) == 0 and b.batch_get_v1(["a", "c"], host(3, 0)) == [False, True]
    assert torch.equal(pool.kv_buffer[:, 3 * P :], before[:, 3 * P :])  # the missed "a"'s target, page 3, untouched


def test_nonfinite_page_is_stored_bit_exact_by_the_lossless_codec():
    pool = SyntheticHostPool("layer_first")
    pool.kv_buffer[0, 1, 3, 0, 0] = float("nan")
    pool.kv_buffer[1, 0, P + 2, 1, 5] = float("-inf")
    b = backend(pool, codec="lossless", interface_v1=1)
    assert b.batch_set_v1(["a", "b"], host(0, 1)) == [True, True]
    want = pool.kv_buffer[:, :, : 2 * P].clone()
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(["a", "b"], host(0, 1)) == [True, True]
    assert torch.equal(pool.kv_buffer[:, :, : 2 * P].view(torch.int16), want.view(torch.int16))  # NaN bits too


def test_unexpected_exceptions_are_caught_counted_and_logged_once_with_traceback(monkeypatch, caplog):
    pool = SyntheticHostPool("page_first")
    b = backend(pool, codec="lossless", interface_v1=1)
    assert b.batch_set_v1(["held"], host(0)) == [True]
    store = b.cache.store

    def boom(*args, **kwargs):
        raise RuntimeError("store bug")

    monkeypatch.setattr(store, "put", boom)
    monkeypatch.setattr(store, "get", boom)
    with caplog.at_level(logging.DEBUG, logger="kv_sglang.storage"):
        assert b.batch_set_v1(["x", "y"], host(1, 2)) == [False, False]
        assert b.set("z", pool.get_data_page(3 * P)) is False
        before = pool.kv_buffer.clone()
        assert b.batch_get_v1(["held"], host(3)) == [False] and b.get("held") is None
        assert torch.equal(pool.kv_buffer, before)
    monkeypatch.setattr(store, "contains", boom)
    assert b.exists("held") is False and b.batch_exists(["held"]) == 0
    m = b.metrics()
    assert m["not_stored_unexpected"] == 3 and m["failed_loads_unexpected"] == 2
    assert m["fault_unexpected"] == 3 + 2 + 2
    first = [r for r in caplog.records if r.levelno == logging.WARNING and "unexpected" in r.getMessage()]
    assert len(first) == 1 and first[0].exc_info is not None  # once, with its traceback


def test_a_decoder_failure_is_a_miss(monkeypatch):
    pool = SyntheticHostPool("layer_first")
    b = backend(pool, codec="kivi-4", interface_v1=1)
    assert b.batch_set_v1(["a"], host(0)) == [True]

    def bad_decode(self, blob, device=None):
        raise IndexError("decoder bug")

    monkeypatch.setattr(type(b.cache.codec), "decode", bad_decode)
    before = pool.kv_buffer.clone()
    assert b.batch_get_v1(["a"], host(1)) == [False] and torch.equal(pool.kv_buffer, before)
    assert b.metrics()["failed_loads_unexpected"] == 1


def test_argument_errors_still_raise():
    """Caller bugs are not faults: they raise, naming the argument, and nothing is counted."""
    pool = SyntheticHostPool("page_first")
    b = backend(pool, interface_v1=1)
    with pytest.raises(ValueError, match="value must be a torch.float16 page"):
        b.set("k", torch.zeros(7, dtype=torch.float16))
    with pytest.raises(ValueError, match="value must be"):
        b.set("k", pool.get_data_page(0).float())
    with pytest.raises(ValueError, match="values must hold one page per key"):
        b.batch_set(["a", "b"], [pool.get_data_page(0)])
    with pytest.raises(ValueError, match="target_location must be"):
        b.get("k", torch.zeros(3))
    with pytest.raises(ValueError, match="host_indices must hold page_size"):
        b.batch_set_v1(["a", "b"], host(0))
    with pytest.raises(ValueError, match="host_indices must hold page_size"):
        b.batch_get_v1(["a"], [0] * P)
    with pytest.raises(ValueError, match="host_indices: host index 3 is not page aligned"):
        b.batch_get_v1(["a"], torch.arange(3, 3 + P))
    with pytest.raises(ValueError, match="outside the host pool"):
        b.batch_get_v1(["a"], host(7))
    with pytest.raises(TypeError, match="key must be a non-empty str"):
        b.exists(3)
    with pytest.raises(TypeError, match="keys must be a list of str"):
        b.batch_exists("abc")
    m = b.metrics()
    assert m["hits"] == m["misses"] == m["stored_pages"] == 0
    assert all(v == 0 for k, v in m.items() if k.startswith("fault_"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariant_every_load_is_exact_or_a_miss_under_random_faults(tmp_path, monkeypatch, seed):
    """Invariant (lossless): under any mix of full disks, read errors, deleted and damaged files, every backend call
    returns normally, a load reported True equals the page last stored under its key bit for bit, a load reported
    False leaves its target page as it was, and hits + misses equals the loads asked for."""
    rng = random.Random(seed)
    pool = SyntheticHostPool("page_first", pages=8, seed=seed)
    b = backend(pool, codec="lossless", cpu_bytes=0, disk_dir=str(tmp_path), interface_v1=1)
    written: dict[str, torch.Tensor] = {}  # key -> page [2, L, P, H, D] as stored
    real_fdopen, real_read = os.fdopen, pathlib.Path.read_bytes
    loads = 0
    for _step in range(40):
        fault = rng.choice(["none", "none", "enospc", "eio", "delete", "damage"])
        keys = rng.sample([f"k{i}" for i in range(6)], 2)
        pages = rng.sample(range(8), 2)
        if fault == "enospc":
            monkeypatch.setattr(os, "fdopen", enospc_fdopen(real_fdopen))
        if fault == "eio":
            monkeypatch.setattr(pathlib.Path, "read_bytes", eio_read_bytes)
        if fault in ("delete", "damage") and files_of(tmp_path):
            f = rng.choice(files_of(tmp_path))
            if fault == "delete":
                f.unlink()
            else:
                raw = bytearray(real_read(f))
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
                f.write_bytes(bytes(raw))
        if rng.random() < 0.5:
            pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer.float()).to(pool.dtype))
            held_before = {k: b.exists(k) for k in keys}
            ok = b.batch_set_v1(keys, host(*pages))
            for k, page, stored in zip(keys, pages, ok):
                if stored and not held_before[k]:
                    written[k] = pool.page_kv(page * P).clone()
        else:
            before = pool.kv_buffer.clone()
            ok = b.batch_get_v1(keys, host(*pages))
            loads += len(keys)
            for k, page, loaded in zip(keys, pages, ok):
                if loaded:
                    assert torch.equal(pool.page_kv(page * P), written[k])
                else:
                    assert torch.equal(pool.page_kv(page * P), before[:, page * P : (page + 1) * P].transpose(1, 2))
        monkeypatch.undo()
    m = b.metrics()
    assert m["hits"] + m["misses"] == loads
    assert m["hits"] > 0 and m["misses"] > 0 and m["fault_disk_full"] + m["fault_io_error"] > 0  # not vacuous


# ----------------------------------------------------------------------------------- shared disk, one budget
def _file_bytes(tmp_path):
    return sum(f.stat().st_size for f in files_of(tmp_path))


def test_two_tp_ranks_sharing_a_disk_dir_stay_within_one_budget(tmp_path):
    pools = [SyntheticHostPool("layer_first", pages=8, seed=s) for s in (0, 1)]
    probe_dir, tmp_path = tmp_path / "probe", tmp_path / "shared"
    probe_dir.mkdir()
    tmp_path.mkdir()
    disk_backend(probe_dir, pools[0]).batch_set_v1(["r9p9"], host(0))  # keys of one length: files of one size
    budget = 3 * _file_bytes(probe_dir) + 100  # three page files
    ranks = [disk_backend(tmp_path, pool, tp_rank=r, tp_size=2, disk_bytes=budget) for r, pool in enumerate(pools)]
    for i in range(8):
        for r, b in enumerate(ranks):
            assert b.batch_set_v1([f"r{r}p{i}"], host(i)) == [True]
            assert _file_bytes(tmp_path) <= budget  # one budget for the directory, whoever writes
    assert len(files_of(tmp_path)) == 3
    # lookups tell the truth after the other rank's evictions, and every load is exact or a miss
    for r, b in enumerate(ranks):
        for i in range(8):
            key = f"r{r}p{i}"
            held = b.batch_exists([key]) == 1
            target = pools[r].page_kv(0).clone()
            got = b.batch_get_v1([key], host(0))
            assert got == [held]
            if held:
                assert torch.equal(pools[r].page_kv(0), SyntheticHostPool("layer_first", 8, seed=r).page_kv(i * P))
            else:
                assert torch.equal(pools[r].page_kv(0), target)
    assert sum(b.metrics()["hits"] for b in ranks) == 3
    assert all(b.metrics()["fault_vanished"] == 0 for b in ranks)  # evictions are announced, not discovered


# ------------------------------------------------------------------------------------------ SGLang's contracts
def _sglang_source(module):
    spec = importlib.util.find_spec(module)
    return pathlib.Path(spec.origin).read_text()


def _definition(source, name):
    """The source of the top-level class or function ``name`` in ``source``."""
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(source.splitlines()[first - 1 : node.end_lineno])


def test_get_stats_returns_sglangs_storage_metrics(monkeypatch):
    """SGLang's scheduler asserts ``isinstance(get_stats(), StorageMetrics)``. Its module cannot be imported here
    (it pulls in torchvision), so its StorageMetrics class is built from SGLang's own source and registered under
    the module's name, as it is in a server; get_stats must return that class, filled per call and drained."""
    source = _sglang_source("sglang.srt.observability.metrics_collector")
    assert "assert isinstance(storage_metrics, StorageMetrics)" in source  # what the check below is for
    module = types.ModuleType("sglang.srt.observability.metrics_collector")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(
        "from __future__ import annotations\nfrom dataclasses import dataclass, field\nfrom typing import List\n"
        + _definition(source, "StorageMetrics"),
        module.__dict__,
    )
    pool = SyntheticHostPool("page_first")
    b = backend(pool, codec="kivi-4", interface_v1=1, storage_metrics=True)
    assert b.batch_set_v1(["a", "b", "c"], host(0, 1, 2)) == [True] * 3
    assert b.batch_set_v1(["a", "d"], host(0, 3)) == [True] * 2  # "a" already held: not a page written
    assert b.batch_get_v1(["a", "b", "zz"], host(0, 1, 2)) == [True, True, False]
    stats = b.get_stats()
    assert type(stats) is module.StorageMetrics
    assert stats.backup_pgs == [3, 1] and stats.prefetch_pgs == [3]
    assert len(stats.backup_bandwidth) == 2 and len(stats.prefetch_bandwidth) == 1
    assert all(bw > 0 for bw in stats.backup_bandwidth + stats.prefetch_bandwidth)
    again = b.get_stats()
    assert again.backup_pgs == again.prefetch_pgs == again.prefetch_bandwidth == again.backup_bandwidth == []
    quiet = backend(pool, interface_v1=1)  # storage metrics off: nothing accumulates
    quiet.batch_set_v1(["a"], host(0))
    assert quiet.get_stats().backup_pgs == []
    # without SGLang's module loaded, a stand-in with the same fields
    monkeypatch.delitem(sys.modules, module.__name__)
    stand_in = {f.name for f in dataclasses.fields(b.get_stats())}
    assert stand_in == {f.name for f in dataclasses.fields(module.StorageMetrics)}


def test_get_stats_logs_the_cumulative_metrics_at_most_once_a_minute(caplog):
    pool = SyntheticHostPool("page_first")
    b = backend(pool, interface_v1=1)
    b.batch_set_v1(["a"], host(0))
    with caplog.at_level(logging.INFO, logger="kv_sglang.storage"):
        b.get_stats()
        b.get_stats()
    lines = [r.getMessage() for r in caplog.records if "kv_sglang storage metrics" in r.getMessage()]
    assert len(lines) == 1 and "'stored_pages': 1" in lines[0] and "'hits'" not in lines[0]  # non-zero values only


def test_metrics_dict_lists_every_fault_kind_and_reason():
    b = backend(SyntheticHostPool("layer_first"))
    m = b.metrics()
    for kind in kvpages.FAULT_KINDS:
        assert m[f"fault_{kind}"] == 0 and m[f"store_fault_{kind}"] == 0
    for reason in ("absent", "store", "corrupt", "unexpected"):
        assert m[f"failed_loads_{reason}"] == 0
    for reason in ("nonfinite", "codec", "store", "unexpected"):
        assert m[f"not_stored_{reason}"] == 0
    for name in ("hits", "misses", "stored_bytes", "fp16_bytes", "bytes_saved", "store_cpu_bytes"):
        assert m[name] == 0


def test_sglang_page_hashes_fold_in_extra_key_and_cache_salt():
    """The backend keys pages by SGLang's page hashes and adds no request namespace of its own: that is only safe
    because SGLang 0.5.23 seeds every storage hash chain with the request's extra_key (LoRA id) and cache_salt.
    This pins that contract in SGLang's source, and runs its seed function (pure Python)."""
    utils = _sglang_source("sglang.srt.mem_cache.utils")
    storage_hash = _definition(utils, "get_storage_hash_str")
    assert "storage_namespace_seed(" in storage_hash
    assert 'getattr(key, "extra_key", None)' in storage_hash and 'getattr(key, "cache_salt", None)' in storage_hash
    assert "get_storage_hash_str(node.key" in _definition(utils, "compute_node_hash_values")  # backup keys
    controller = _sglang_source("sglang.srt.managers.cache_controller")
    assert "get_storage_hash_str(" in controller and "tokens_to_fetch = operation.token_ids" in controller  # lookups
    unified = _sglang_source("sglang.srt.mem_cache.unified_radix_cache")
    assert "prefetch_key = RadixKey(" in unified and "cache_salt=cache_salt," in unified  # the key carries both
    scope = {"hashlib": hashlib, "Optional": typing.Optional}
    exec(_definition(utils, "storage_namespace_seed"), scope)
    seed = scope["storage_namespace_seed"]
    seeds = [seed(None, None), seed("lora-a", None), seed("lora-b", None), seed(None, "lora-a"), seed("", None)]
    assert seeds[0] is None and len(set(seeds[1:])) == 4  # every namespace starts its own chain
