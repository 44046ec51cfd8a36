"""TieredStore: byte-budget LRU, disk spill and reload, corruption -> miss, restart, thread safety, bad arguments."""

import os
import threading

import pytest

from kvpages import TieredStore


def blob(i, n=100):
    return bytes([i % 256]) * n


def test_cpu_lru_evicts_least_recently_used_within_budget():
    s = TieredStore(cpu_bytes=300)
    for i in range(3):
        s.put(f"k{i}", blob(i))
    assert s.get("k0") == blob(0)  # k0 becomes most recent
    s.put("k3", blob(3))  # over budget: k1 (least recent) goes
    assert s.keys() == ["k2", "k0", "k3"]
    assert s.get("k1") is None
    m = s.metrics
    assert (m.cpu_bytes, m.cpu_entries, m.evictions, m.hits, m.misses) == (300, 3, 1, 1, 1)


def test_budget_is_never_exceeded_and_oversized_blobs_are_rejected():
    s = TieredStore(cpu_bytes=250)
    for i in range(20):
        s.put(f"k{i}", blob(i, 10 + 17 * (i % 7)))
        assert s.metrics.cpu_bytes <= 250
        assert s.metrics.cpu_bytes == sum(len(s.get(k)) for k in s.keys())  # noqa: SIM118
    s.put("huge", blob(1, 251))
    assert not s.contains("huge") and s.metrics.rejected == 1


def test_put_replaces_and_delete_removes():
    s = TieredStore(cpu_bytes=1000)
    s.put("a", blob(1))
    s.put("a", blob(2, 50))
    assert s.get("a") == blob(2, 50) and s.metrics.cpu_bytes == 50
    assert s.delete("a") and not s.delete("a")
    assert s.get("a") is None and s.metrics.cpu_bytes == 0


def test_spill_to_disk_and_reload(tmp_path):
    s = TieredStore(cpu_bytes=200, disk_dir=tmp_path)
    for i in range(5):
        s.put(f"k{i}", blob(i))
    m = s.metrics
    assert m.cpu_entries == 2 and m.disk_entries == 3 and m.spills == 3 and m.evictions == 0
    assert len(list(tmp_path.glob("*.kvp"))) == 3
    assert s.get("k0") == blob(0)  # from disk, promoted to CPU (k3 spills)
    assert s.metrics.disk_hits == 1
    assert all(s.get(f"k{i}") == blob(i) for i in range(5))
    assert sorted(s.keys()) == [f"k{i}" for i in range(5)]


def test_disk_budget_evicts_oldest_files(tmp_path):
    s = TieredStore(cpu_bytes=0, disk_dir=tmp_path, disk_bytes=3 * 200)
    for i in range(6):
        s.put(f"key-{i}", blob(i, 150))
    m = s.metrics
    assert m.disk_bytes <= 600 and m.disk_entries == 3 and m.evictions == 3
    assert [s.get(f"key-{i}") is not None for i in range(6)] == [False] * 3 + [True] * 3
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kvp")) == s.metrics.disk_bytes


def test_restart_reindexes_disk_and_drops_partial_writes(tmp_path):
    s = TieredStore(cpu_bytes=0, disk_dir=tmp_path)
    s.put("alpha", blob(7))
    (tmp_path / ".tmp-interrupted").write_bytes(b"partial")
    s2 = TieredStore(cpu_bytes=100, disk_dir=tmp_path)
    assert s2.contains("alpha") and s2.get("alpha") == blob(7)
    assert not (tmp_path / ".tmp-interrupted").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "delete"])
def test_corrupt_disk_entry_is_a_counted_miss_and_dropped(tmp_path, damage):
    s = TieredStore(cpu_bytes=0, disk_dir=tmp_path)
    s.put("k", blob(3, 500))
    (path,) = tmp_path.glob("*.kvp")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[300] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    assert s.get("k") is None
    m = s.metrics
    kind = "vanished" if damage == "delete" else "corrupt"  # a deleted file is not damage, but still a miss
    assert (m.faults[f"fault_{kind}"], m.misses, m.disk_entries, m.disk_bytes) == (1, 1, 0, 0)
    assert m.corrupt == (damage != "delete")
    assert not s.contains("k") and not path.exists()
    assert s.take_changes() == ([], ["k"])  # an index kept elsewhere learns the entry is gone


def test_thread_safety_smoke(tmp_path):
    """Invariant under concurrent put/get/delete: every read is a blob some writer stored under that key, and the
    byte accounting matches the held entries at the end."""
    s = TieredStore(cpu_bytes=2000, disk_dir=tmp_path, disk_bytes=4000)
    errors = []

    def worker(t):
        try:
            for i in range(150):
                key = f"k{(i * 7 + t) % 40}"
                s.put(key, key.encode() * (5 + i % 9))
                got = s.get(f"k{(i + t) % 40}")
                if got is not None and not got.startswith(f"k{(i + t) % 40}".encode()):
                    errors.append(got[:10])
                if i % 11 == 0:
                    s.delete(key)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    m = s.metrics
    assert m.cpu_bytes <= 2000 and m.disk_bytes <= 4000
    assert m.disk_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.kvp"))
    assert m.corrupt == 0


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cpu_bytes must be an int >= 0"):
        TieredStore(cpu_bytes=-1)
    with pytest.raises(TypeError, match="cpu_bytes must be an int"):
        TieredStore(cpu_bytes=1.5)
    with pytest.raises(ValueError, match="disk_bytes must be"):
        TieredStore(cpu_bytes=0, disk_dir=tmp_path, disk_bytes=-5)
    with pytest.raises(ValueError, match="disk_bytes needs disk_dir"):
        TieredStore(cpu_bytes=0, disk_bytes=10)
    with pytest.raises(ValueError, match="does not exist"):
        TieredStore(cpu_bytes=0, disk_dir=tmp_path / "missing")
    with pytest.raises(TypeError, match="disk_dir"):
        TieredStore(cpu_bytes=0, disk_dir=3)
    s = TieredStore(cpu_bytes=10)
    with pytest.raises(TypeError, match="key"):
        s.put("", b"x")
    with pytest.raises(TypeError, match="blob must be bytes"):
        s.put("a", "text")
    with pytest.raises(TypeError, match="key"):
        s.get(5)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_read_only_directory_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            TieredStore(cpu_bytes=0, disk_dir=tmp_path)
    finally:
        tmp_path.chmod(0o700)
