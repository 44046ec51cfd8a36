"""Worker-side data path without vLLM: paged layers -> store -> paged layers, failures, metrics, budgets."""

import pytest
import torch

import kvpages
from kv_vllm import BlockTransfer, WorkerState

B, H, N, D = 8, 2, 32, 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def paged(dtype=torch.float16):
    return {name: torch.randn(B, H, N, 2 * D).to(dtype) for name in LAYERS}


def save(worker, layers, transfers):
    for name, kv in layers.items():
        worker.save_layer(name, kv, transfers)
    return worker.flush()


def test_lossless_round_trip_is_bit_exact_and_reports():
    worker = WorkerState(kvpages.codec("lossless"), kvpages.TieredStore(1 << 24), "cpu")
    src = paged(torch.bfloat16)
    saves = [BlockTransfer("k0", 3), BlockTransfer("k1", 5)]
    assert save(worker, src, saves) == ["k0", "k1"]
    dst = {name: torch.zeros_like(kv) for name, kv in src.items()}
    failed = worker.load(dst, {"r": [BlockTransfer("k0", 0), BlockTransfer("k1", 1)]})
    assert failed == set()
    for name in LAYERS:
        assert torch.equal(dst[name][0], src[name][3]) and torch.equal(dst[name][1], src[name][5])
        assert not dst[name][2:].any()
    stored, failed, evicted = worker.take_report()
    assert stored == ["k0", "k1"] and failed == evicted == [] and worker.take_report() == ([], [], [])
    m = worker.metrics
    assert m.saved_blocks == 2 and m.loaded_blocks == 2 and m.hits == 2
    assert m.fp16_bytes == 2 * len(LAYERS) * 2 * N * H * D * 2
    assert m.stored_bytes > m.fp16_bytes  # lossless bf16: raw bytes plus framing


@pytest.mark.parametrize("name,bits,ratio_low", [("kivi-4", 4, 2.0), ("kivi-2", 2, 3.0)])
def test_lossy_round_trip_within_bound_and_smaller(name, bits, ratio_low):
    """KIVI pages: |error| <= scale/2 per group (keys per channel over the block, values per token per 32)."""
    worker = WorkerState(kvpages.codec(name), kvpages.TieredStore(1 << 24), "split_last")
    src = paged(torch.float32)
    save(worker, src, [BlockTransfer("k", 2)])
    dst = {n: torch.zeros_like(kv) for n, kv in src.items()}
    assert worker.load(dst, {"r": [BlockTransfer("k", 6)]}) == set()
    for layer in LAYERS:
        k_src = src[layer][2, ..., :D]  # [H, N, D]
        v_src = src[layer][2, ..., D:]
        k_dst, v_dst = dst[layer][6, ..., :D], dst[layer][6, ..., D:]
        levels = 2**bits - 1
        k_scale = (k_src.amax(dim=1, keepdim=True) - k_src.amin(dim=1, keepdim=True)) / levels  # per channel
        vg = v_src.reshape(H, N, D // 32, 32)
        v_scale = ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / levels).expand_as(vg).reshape(H, N, D)
        assert ((k_dst - k_src).abs() <= k_scale / 2 + 1e-5).all()
        assert ((v_dst - v_src).abs() <= v_scale / 2 + 1e-5).all()
    # codes take bits/16 of fp16; per-group scales and zeros and the framing eat part of it on a 32-token block
    assert worker.metrics.fp16_bytes / worker.metrics.stored_bytes > ratio_low


def test_missing_and_corrupt_entries_fail_the_rest_of_the_request_and_write_nothing():
    store = kvpages.TieredStore(1 << 24)
    worker = WorkerState(kvpages.codec("lossless"), store, "cpu")
    src = paged()
    save(worker, src, [BlockTransfer("a", 0), BlockTransfer("b", 1), BlockTransfer("c", 2)])
    entry = store.get("b")
    store.put("b", entry[:-7] + bytes(7))  # damaged in place
    dst = {n: torch.zeros_like(kv) for n, kv in src.items()}
    failed = worker.load(
        dst,
        {
            "r": [BlockTransfer("a", 4), BlockTransfer("b", 5), BlockTransfer("c", 6)],
            "q": [BlockTransfer("zz", 7)],
        },
    )
    assert failed == {5, 6, 7}
    for n in LAYERS:
        assert torch.equal(dst[n][4], src[n][0])
        assert not dst[n][5:].any()  # nothing written into failed blocks
    assert not store.contains("b")  # the corrupt entry is dropped
    _, failed, evicted = worker.take_report()
    assert sorted(failed) == ["b", "zz"] and evicted == []  # the dropped corrupt entry is reported once, as failed
    assert worker.metrics.corrupt == 1 and worker.metrics.misses == 1


def test_entry_from_another_codec_is_a_miss():
    store = kvpages.TieredStore(1 << 24)
    src = paged()
    save(WorkerState(kvpages.codec("kivi-4"), store, "cpu"), src, [BlockTransfer("a", 0)])
    reader = WorkerState(kvpages.codec("lossless"), store, "cpu")
    assert reader.load({n: torch.zeros_like(kv) for n, kv in src.items()}, {"r": [BlockTransfer("a", 1)]}) == {1}


def test_budget_is_respected_and_oversized_blocks_are_not_reported():
    src = paged()
    one = len(
        WorkerState(kvpages.codec("lossless"), kvpages.TieredStore(1 << 24), "cpu").codec.encode(
            torch.zeros(N, H, D, dtype=torch.float16), torch.zeros(N, H, D, dtype=torch.float16)
        )
    )
    store = kvpages.TieredStore(3 * len(LAYERS) * one + 200)  # room for about 3 blocks
    worker = WorkerState(kvpages.codec("lossless"), store, "cpu")
    stored = save(worker, src, [BlockTransfer(f"k{i}", i) for i in range(6)])
    assert stored == [f"k{i}" for i in range(6)]  # each fit when it was put
    assert store.metrics.cpu_bytes <= store.cpu_budget
    assert len(store.keys()) < 6  # the oldest were evicted
    reported, failed, evicted = worker.take_report()  # the scheduler is told only what is still held
    assert reported == store.keys() and sorted(reported + evicted) == sorted(stored) and failed == []
    tiny = WorkerState(kvpages.codec("lossless"), kvpages.TieredStore(100), "cpu")
    assert save(tiny, src, [BlockTransfer("x", 0)]) == []  # larger than the whole budget: not promised
    assert tiny.metrics.not_stored == 1 and tiny.fault_counts()["fault_over_budget"] == 1


def test_disk_tier_survives_a_new_worker(tmp_path):
    src = paged()
    w1 = WorkerState(kvpages.codec("kivi-4"), kvpages.TieredStore(0, disk_dir=tmp_path), "cpu")
    save(w1, src, [BlockTransfer("a", 0)])
    w2 = WorkerState(kvpages.codec("kivi-4"), kvpages.TieredStore(1 << 20, disk_dir=tmp_path), "cpu")
    w2.announce_existing()
    assert w2.take_report() == (["a"], [], [])
    assert w2.load({n: torch.zeros_like(kv) for n, kv in src.items()}, {"r": [BlockTransfer("a", 1)]}) == set()


def test_a_non_finite_page_under_a_lossy_codec_is_not_stored_and_counted():
    worker = WorkerState(kvpages.codec("kivi-4"), kvpages.TieredStore(1 << 24), "cpu", LAYERS)
    src = paged(torch.float32)
    src[LAYERS[1]][1, 0, 3, 5] = float("nan")  # block 1 of the second layer only
    assert save(worker, src, [BlockTransfer("a", 0), BlockTransfer("b", 1)]) == ["a"]
    assert worker.metrics.not_stored == 1 and worker.fault_counts()["fault_nonfinite"] == 1
    assert not worker.store.contains("b")


def test_an_entry_lacking_a_layer_is_not_stored():
    worker = WorkerState(kvpages.codec("lossless"), kvpages.TieredStore(1 << 24), "cpu", LAYERS)
    src = paged()
    worker.save_layer(LAYERS[0], src[LAYERS[0]], [BlockTransfer("a", 0)])  # the second layer never saved
    assert worker.flush() == [] and worker.fault_counts()["fault_codec"] == 1


@pytest.mark.parametrize("code,kind", [(28, "disk_full"), (5, "io_error"), (13, "permission")])
def test_disk_faults_on_save_and_load_never_escape(tmp_path, monkeypatch, code, kind):
    """A failing disk: saves are "not stored", loads of disk entries fail (recompute); counted by kind."""
    import os
    from pathlib import Path

    store = kvpages.TieredStore(0, disk_dir=tmp_path)  # everything on disk
    worker = WorkerState(kvpages.codec("lossless"), store, "cpu", LAYERS)
    src = paged()
    assert save(worker, src, [BlockTransfer("a", 0)]) == ["a"]

    def failing(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(Path, "read_bytes", failing)
    monkeypatch.setattr(os, "replace", failing)
    assert save(worker, src, [BlockTransfer("b", 1)]) == []
    dst = {n: torch.zeros_like(kv) for n, kv in src.items()}
    assert worker.load(dst, {"r": [BlockTransfer("a", 2), BlockTransfer("b", 3)]}) == {2, 3}
    assert not any(kv.any() for kv in dst.values())  # nothing written
    faults = worker.fault_counts()
    assert faults[f"fault_{kind}"] == 2  # the failed write and the failed read
    assert worker.metrics.not_stored == 1 and worker.metrics.failed_loads == 2
    stored, failed, evicted = worker.take_report()
    # "a" was stored, then dropped when unreadable: the scheduler hears it once, as a failed load
    assert (stored, failed, evicted) == ([], ["a"], []) and not store.contains("a")


def test_reset_drops_every_entry(tmp_path):
    worker = WorkerState(kvpages.codec("lossless"), kvpages.TieredStore(1 << 20, disk_dir=tmp_path), "cpu")
    save(worker, paged(), [BlockTransfer("a", 0)])
    worker.reset()
    assert len(worker.store) == 0 and worker.take_report() == ([], [], [])


METHOD_CODECS = ["hex-3", "hex-4", "kcvt-3", "kcvt-4", "hqekv-2", "hqekv-2.8", "hqekv-3.2", "hqekv-3.25"]


@pytest.mark.parametrize("name", METHOD_CODECS)
def test_method_codecs_round_trip_through_the_worker(name):
    """Codecs a method package registers (kv-hex, kv-hqekv) run through the connector unchanged: found by name,
    validated by ConnectorConfig, and each loaded block equals the codec's own round trip of the page it saved."""
    from kv_vllm import ConnectorConfig
    from kv_vllm.layout import gather_blocks

    assert name in kvpages.codec_names()
    cfg = ConnectorConfig(codec=name)
    worker = WorkerState(cfg.build_codec(), cfg.build_store(), "split_last")
    src = paged(torch.float16)
    save(worker, src, [BlockTransfer("k", 2)])
    dst = {n: torch.zeros_like(kv) for n, kv in src.items()}
    assert worker.load(dst, {"r": [BlockTransfer("k", 6)]}) == set()
    codec = cfg.build_codec()
    for layer in LAYERS:
        keys, values = gather_blocks(src[layer], [2], "split_last")
        k_want, v_want = codec.decode(codec.encode(keys[0], values[0]))
        k_got, v_got = gather_blocks(dst[layer], [6], "split_last")
        assert torch.equal(k_got[0], k_want) and torch.equal(v_got[0], v_want)
        assert not torch.equal(k_got[0], keys[0])  # lossy: the block really went through the codec
    assert worker.metrics.fp16_bytes / worker.metrics.stored_bytes > 1.5
