"""Layout conversion and settings validation (no engine needed)."""

import pytest
import torch

from kv_sglang import LAYOUTS, PageGeometry, StorageSettings


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_page_round_trip_and_token_order(layout):
    """Invariant: from_kv(to_kv(page)) == page, and to_kv puts token t of layer l, head h at [t, l*H + h]."""
    L, P, H, D = 3, 4, 2, 5
    g = PageGeometry(layout, L, P, H, D, torch.float32)
    page = torch.randn(g.page_elements)
    k, v = g.to_kv(page)
    assert k.shape == (P, L * H, D)
    shaped = page.view((2, P, L, H, D) if layout == "page_first" else (2, L, P, H, D))
    kl = shaped[0, 2, 1, 1] if layout != "page_first" else shaped[0, 1, 2, 1]  # layer 2, token 1, head 1
    assert torch.equal(k[1, 2 * H + 1], kl)
    out = torch.zeros_like(page)
    g.from_kv(k, v, out)
    assert torch.equal(out, page)
    with pytest.raises(ValueError, match="page keys/values must be"):
        g.from_kv(k[:1], v, out)


def test_geometry_refuses_unsupported_pools():
    with pytest.raises(NotImplementedError, match="page_head"):
        PageGeometry("page_head", 1, 1, 1, 1, torch.float16)
    with pytest.raises(NotImplementedError, match="MHA host pool"):
        PageGeometry.of_pool(object())
    with pytest.raises(ValueError, match="page aligned"):
        PageGeometry("layer_first", 1, 4, 1, 1, torch.float16).host_page(torch.zeros(2, 1, 8, 1, 1), 3)


def test_settings_validation(tmp_path):
    s = StorageSettings.from_extra_config(
        {"codec": "kivi-2", "cpu_bytes": 10, "disk_dir": str(tmp_path), "class_name": "x"}
    )
    assert s.codec == "kivi-2" and s.build_cache().store.disk_dir == tmp_path
    for bad, match in [
        ({"codec": "nope"}, "unknown codec"),
        ({"cpu_bytes": -3}, "cpu_bytes"),
        ({"disk_dir": str(tmp_path / "absent")}, "does not exist"),
        ({"typo": 1}, "unknown kv_sglang config keys"),
    ]:
        with pytest.raises(ValueError, match=match):
            StorageSettings.from_extra_config(bad)


METHOD_CODECS = ["hex-3", "hex-4", "kcvt-3", "kcvt-4", "hqekv-2", "hqekv-2.8", "hqekv-3.2", "hqekv-3.25"]


@pytest.mark.parametrize("name", METHOD_CODECS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_method_codecs_store_and_reload_a_host_page(tmp_path, name, layout):
    """Codecs a method package registers (kv-hex, kv-hqekv) run through the HiCache backend's settings and page path
    unchanged: a flat host page -> to_kv -> the settings' codec and tiered store (disk tier too) -> from_kv gives
    the codec's own round trip of the page, in fewer bytes than fp16."""
    L, P, H, D = 2, 64, 3, 64  # SmolLM2's KV heads and head dim; SGLang's recommended page size for lossy codecs
    g = PageGeometry(layout, L, P, H, D, torch.float16)
    page = torch.randn(g.page_elements).to(torch.float16)
    s = StorageSettings.from_extra_config({"codec": name, "cpu_bytes": 0, "disk_dir": str(tmp_path)})
    cache = s.build_cache()
    k, v = g.to_kv(page)
    nbytes = cache.save("page-0", k, v)
    assert 0 < nbytes < cache.codec.fp16_bytes(*k.shape) / 2
    k2, v2 = cache.load("page-0")
    out = torch.zeros_like(page)
    g.from_kv(k2, v2, out)
    k_want, v_want = cache.codec.decode(cache.codec.encode(k, v))
    assert torch.equal(k2, k_want) and torch.equal(v2, v_want)
    assert torch.equal(g.to_kv(out)[0], k_want) and not torch.equal(out, page)
    other = StorageSettings.from_extra_config({"codec": "kivi-2", "cpu_bytes": 0, "disk_dir": str(tmp_path)})
    assert other.build_cache().load("page-0") is None  # pages are keyed by the codec's config hash
