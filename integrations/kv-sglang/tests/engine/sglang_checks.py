"""Checks against SGLang's real HiCacheStorage, HiCacheStorageConfig and StorageBackendFactory (run by test_engine).

The host pools here are synthetic: SGLang's ``MHATokenToKVPoolHost`` cannot be built on CPU without the CUDA
pieces its module imports (torchvision via sglang.srt.configs), so ``SyntheticHostPool`` holds a ``kv_buffer`` of
each documented layout and reproduces ``get_data_page`` / ``get_dummy_flat_data_page`` / ``set_from_flat_data_page``
of SGLang 0.5.23 (``mem_cache/pool_host/mha.py``).
"""

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

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


def config(**extra):
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="tiny-llama",
        extra_config={
            "backend_name": "kvcompress",
            "module_path": "kv_sglang",
            "class_name": "KVCompressStorage",
            **extra,
        },
    )


def backend(pool=None, **extra):
    b = StorageBackendFactory.create_backend("dynamic", config(**extra), pool)
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
        ({"cpu_bytes": "1G"}, ValueError, "cpu_bytes"),
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
    assert b.get_stats()["store_corrupt"] == 2 and not b.exists("p0")


def test_budget_eviction():
    pool = SyntheticHostPool("layer_first", pages=4)
    page_blob = len(backend(pool, codec="kivi-2").cache.codec.encode(*pool_kv(pool, 0)))
    b = backend(pool, codec="kivi-2", cpu_bytes=2 * page_blob)
    for i in range(4):
        assert b.set(f"k{i}", pool.get_data_page(i * P))
    assert [b.exists(f"k{i}") for i in range(4)] == [False, False, True, True]
    stats = b.get_stats()
    assert stats["store_evictions"] == 2 and stats["store_cpu_bytes"] <= 2 * page_blob
    assert stats["fp16_bytes"] / stats["stored_bytes"] > 4  # kivi-2 on 16-token pages (key scales per 16 tokens)


def pool_kv(pool, index):
    from kv_sglang import PageGeometry

    return PageGeometry.of_pool(pool).to_kv(pool.get_data_page(index))
