"""TieredStore under faults (full disk, I/O and permission errors, oversized entries) and shared by processes.

Every fault must become "not stored" or a miss, counted by kind, never an exception; an index kept elsewhere learns
through ``take_changes`` what left the store. Several processes sharing one directory keep one budget.
"""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpages import FAULT_KINDS, TieredStore, os_fault_kind


def blob(key: str, n: int) -> bytes:
    return (key.encode() * (n // len(key) + 1))[:n]


class _FailingFile:
    def __init__(self, code):
        self.code = code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, data):
        raise OSError(self.code, os.strerror(self.code))


def _fail_writes(monkeypatch, code):
    real = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        if "w" in mode:
            os.close(fd)
            return _FailingFile(code)
        return real(fd, mode, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fdopen)


def _fail_reads(monkeypatch, code):
    def read_bytes(self):
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize(
    "code,kind", [(errno.ENOSPC, "disk_full"), (errno.EIO, "io_error"), (errno.EACCES, "permission")]
)
def test_a_failing_disk_write_is_not_stored_and_counted(tmp_path, monkeypatch, code, kind):
    s = TieredStore(cpu_bytes=150, disk_dir=tmp_path)
    s.put("a", blob("a", 100))
    _fail_writes(monkeypatch, code)
    assert s.put("big", blob("big", 400)) is False  # straight to disk: the write fails, nothing escapes
    assert s.put("b", blob("b", 100)) is True  # "a" is pushed out of the CPU tier; its spill fails: evicted
    m = s.metrics
    assert m.faults[f"fault_{kind}"] == 2 and m.evictions == 1 and m.spills == 0
    assert not s.contains("big") and not s.contains("a") and s.get("b") == blob("b", 100)
    assert list(tmp_path.glob(".tmp-*")) == [] and list(tmp_path.glob("*.kvp")) == []
    assert s.take_changes() == ([], ["a"])
    monkeypatch.undo()  # the disk recovers: writes work again
    assert s.put("big", blob("big", 400)) and s.get("big") == blob("big", 400)


@pytest.mark.parametrize("code,kind", [(errno.EIO, "io_error"), (errno.EACCES, "permission")])
def test_a_failing_disk_read_is_a_miss_and_the_entry_is_dropped(tmp_path, monkeypatch, code, kind):
    s = TieredStore(cpu_bytes=0, disk_dir=tmp_path)
    assert s.put("k", blob("k", 300))
    _fail_reads(monkeypatch, code)
    assert s.get("k") is None
    m = s.metrics
    assert m.faults[f"fault_{kind}"] == 1 and m.misses == 1 and not s.contains("k")
    assert s.take_changes() == ([], ["k"])


def test_an_entry_larger_than_every_tier_is_refused_and_counted(tmp_path):
    s = TieredStore(cpu_bytes=100, disk_dir=tmp_path, disk_bytes=200)
    assert s.put("huge", blob("huge", 500)) is False
    m = s.metrics
    assert m.rejected == 1 and m.faults["fault_over_budget"] == 1 and not s.contains("huge")


def test_faults_are_logged_once_per_kind(tmp_path, monkeypatch, caplog):
    s = TieredStore(cpu_bytes=0, disk_dir=tmp_path)
    _fail_writes(monkeypatch, errno.ENOSPC)
    with caplog.at_level("WARNING", logger="kvpages.tiered"):
        for i in range(5):
            assert not s.put(f"k{i}", blob("x", 50))
    assert s.metrics.faults["fault_disk_full"] == 5
    assert len([r for r in caplog.records if "disk_full" in r.getMessage()]) == 1


def test_os_fault_kinds_cover_the_errnos_and_refuse_other_types():
    assert [os_fault_kind(OSError(c, "x")) for c in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOENT)] == [
        "disk_full",
        "disk_full",
        "permission",
        "vanished",
    ]
    assert os_fault_kind(OSError(errno.EIO, "x")) == "io_error" and "io_error" in FAULT_KINDS
    with pytest.raises(TypeError, match="exc must be an OSError"):
        os_fault_kind(ValueError("x"))


def test_two_stores_in_one_process_see_each_others_writes_and_evictions(tmp_path):
    a = TieredStore(cpu_bytes=0, disk_dir=tmp_path, disk_bytes=1000)
    b = TieredStore(cpu_bytes=0, disk_dir=tmp_path, disk_bytes=1000)
    assert a.put("from-a", blob("a", 300))
    assert b.take_changes() == (["from-a"], []) and b.get("from-a") == blob("a", 300)
    for i in range(4):  # b's writes fill the shared budget: a's entry is the least recently used file
        assert b.put(f"from-b{i}", blob("b", 300))
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kvp")) <= 1000
    added, removed = a.take_changes()
    assert "from-a" in removed and set(added) <= {f"from-b{i}" for i in range(4)}
    assert not a.contains("from-a") and a.get("from-a") is None


_HAMMER = r"""
import fcntl, json, sys, time
from pathlib import Path
from kvpages import TieredStore

def blob(key, n):
    return (key.encode() * (n // len(key) + 1))[:n]

disk_dir, name, budget, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
Path(disk_dir, f"ready-{name}").touch()  # start together: both processes have imported kvpages
deadline = time.monotonic() + 60
while not all(Path(disk_dir, f"ready-{n}").exists() for n in "pq") and time.monotonic() < deadline:
    time.sleep(0.01)
s = TieredStore(cpu_bytes=0, disk_dir=disk_dir, disk_bytes=budget)
other = "q" if name == "p" else "p"
bad = over = seen_other = 0
for i in range(rounds):
    key = f"{name}{i}"
    s.put(key, blob(key, 60 + 37 * (i % 5)))
    want = f"{other}{i // 2}"
    got = s.get(want)
    if got is not None:
        seen_other += 1
        bad += got != blob(want, 60 + 37 * ((i // 2) % 5))
    with open(Path(disk_dir) / ".kvpages.lock", "w") as lock:  # the store's own protocol: hold the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        total = sum(p.stat().st_size for p in Path(disk_dir).glob("*.kvp"))
    over += total > budget
    added, _removed = s.take_changes()
    seen_other += any(k.startswith(other) for k in added)
print(json.dumps({"name": name, "bad": bad, "over": over, "seen_other": seen_other, "corrupt": s.metrics.corrupt}))
"""


def test_two_processes_share_one_directory_and_one_budget(tmp_path):
    """Invariant: with two processes writing into one directory under one budget, the directory never holds more
    than the budget (checked under the store's lock after every put), and every blob read back is exactly the one
    its writer stored (or a miss)."""
    budget = 2_000
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HAMMER, str(tmp_path), name, str(budget), "80"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("p", "q")
    ]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for r in results:
        assert r["bad"] == 0 and r["over"] == 0 and r["corrupt"] == 0, r
        assert r["seen_other"] > 0, r  # each process read entries the other wrote
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kvp")) <= budget
