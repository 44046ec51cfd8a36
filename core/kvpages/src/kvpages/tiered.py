"""A thread- and process-safe, byte-budgeted LRU store of blobs: CPU memory first, an optional disk directory second."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvcore.checks import check_int
from kvpages.faults import FaultLog

logger = logging.getLogger(__name__)

_MAGIC = b"KVPE"
_HEADER = struct.Struct("<4sIQ")  # magic, key length, blob length
_SUM = 16
_SUFFIX = ".kvp"
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".kvpages.lock"
_GEN_NAME = ".kvpages.gen"
_GEN = struct.Struct("<Q")


@dataclass(frozen=True)
class StoreMetrics:
    """A snapshot of a :class:`TieredStore`'s counters.

    ``hits``/``misses`` count :meth:`TieredStore.get` calls (``disk_hits`` of the hits came from disk);
    ``corrupt`` counts entries found damaged and dropped; ``evictions`` counts entries that left the store for
    lack of room (``spills`` counts moves from CPU to disk, which are not evictions); ``rejected`` counts puts
    larger than every tier. ``cpu_bytes``/``disk_bytes`` are the bytes held per tier (disk: file sizes of the
    entries this process has indexed). ``faults`` counts every fault by kind (:data:`kvpages.FAULT_KINDS`):
    a full disk, an I/O or permission error, a file vanished under the store, a corrupt file, an oversized entry.
    """

    hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    spills: int = 0
    rejected: int = 0
    cpu_entries: int = 0
    cpu_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    faults: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "faults"}, **self.faults}


def _check_budget(name: str, value: object, *, optional: bool) -> int | None:
    return check_int(name, value, low=0, optional="no limit" if optional else None)


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty str, got {key!r}")
    return key


class TieredStore:
    """LRU over a byte budget in CPU memory, spilling to a disk directory when one is configured.

    Parameters
    ----------
    cpu_bytes : int
        Budget of the CPU tier (sum of held blob lengths), >= 0.
    disk_dir : str or Path, optional
        An existing, writable directory for the second tier. Entries already there (from an earlier process, or
        from another process using the same directory now) are indexed at creation. Without it, entries evicted
        from the CPU tier are dropped.
    disk_bytes : int, optional
        Budget of the disk tier (sum of the directory's entry files, whichever process wrote them); None is
        unbounded. Only with ``disk_dir``.

    Notes
    -----
    * The tiers are inclusive: a disk hit is copied back to the CPU tier and its file kept, so evicting it from
      the CPU again costs no write. :meth:`put` replaces an existing entry in both tiers.
    * Disk files hold the key, the blob and a blake2b checksum, and are written to a temporary file then renamed
      (atomic on POSIX): a crash never leaves a partial entry under a real name. A file that fails its check is
      deleted, counted in ``metrics.corrupt``, and read as a miss.
    * **Faults never escape.** A full disk, an I/O or permission error, or a file deleted under the store turns a
      put into "not stored" (``put`` returns False) and a get into a miss; each is counted in ``metrics.faults``
      by kind and logged once per kind. Argument errors still raise.
    * **Several processes may share one directory** (engines, tensor-parallel ranks): every change to the
      directory (write, eviction, delete) happens under an exclusive ``flock`` of ``.kvpages.lock`` in it and
      bumps a generation counter (``.kvpages.gen``); a process that sees the generation move re-reads the
      directory before deciding evictions, so the budget holds for the directory as a whole and eviction order
      is least recently used across processes (a disk hit refreshes the file's mtime). :meth:`take_changes`
      reports entries other processes added and entries that left the store, for an index kept elsewhere.
    * Every method takes one lock, so the store can be shared by threads (disk I/O happens under the lock).
    """

    def __init__(self, cpu_bytes: int, disk_dir: str | os.PathLike | None = None, disk_bytes: int | None = None):
        self.cpu_budget = _check_budget("cpu_bytes", cpu_bytes, optional=False)
        self.disk_budget = _check_budget("disk_bytes", disk_bytes, optional=True)
        if disk_dir is None:
            if disk_bytes is not None:
                raise ValueError("disk_bytes needs disk_dir (there is no disk tier without a directory)")
            self.disk_dir = None
        else:
            if not isinstance(disk_dir, (str, os.PathLike)):
                raise TypeError(f"disk_dir must be a str or path, got {type(disk_dir).__name__}")
            path = Path(disk_dir)
            if not path.is_dir():
                raise ValueError(f"disk_dir {str(path)!r} does not exist or is not a directory (create it first)")
            if not os.access(path, os.W_OK | os.X_OK):
                raise ValueError(f"disk_dir {str(path)!r} is not writable")
            self.disk_dir = path
        self.faults = FaultLog(logger, "kvpages.TieredStore")
        self._lock = threading.RLock()
        self._cpu: OrderedDict[str, bytes] = OrderedDict()
        self._cpu_used = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._disk_used = 0
        self._counts = dict.fromkeys(("hits", "disk_hits", "misses", "evictions", "spills", "rejected"), 0)
        self._removed: set[str] = set()  # keys that left every tier since the last take_changes()
        self._added: set[str] = set()  # keys other processes added to the directory since then
        self._gen = -1  # the directory generation this process's disk index reflects
        self._flock_depth = 0
        self._dir_changed = False  # this lock holder changed the directory: bump the generation once, on release
        self._flock_fd: int | None = None
        if self.disk_dir is not None:
            try:
                with self._dir_lock():
                    self._rescan(startup=True)
            except OSError as exc:
                raise ValueError(f"disk_dir {str(self.disk_dir)!r} cannot be used: {exc}") from exc

    # ----------------------------------------------------------------------------------------------- public API
    def put(self, key: str, blob: bytes | bytearray | memoryview) -> bool:
        """Store ``blob`` under ``key`` (replacing any entry), evicting least recently used entries for room.

        Returns whether it is held afterwards: False when it is larger than every tier (``rejected``, fault
        ``over_budget``) or its disk write failed (fault by kind).
        """
        _check_key(key)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"blob must be bytes, got {type(blob).__name__}")
        blob = bytes(blob)
        with self._lock:
            self._remove(key)
            if len(blob) <= self.cpu_budget:
                self._cpu[key] = blob
                self._cpu_used += len(blob)
                self._removed.discard(key)
                self._shrink_cpu()
                return key in self._cpu or key in self._disk
            if self.disk_dir is not None and self._fits_disk(self._file_size(key, blob)):
                if self._write_disk_safely(key, blob, "entry not stored"):
                    self._removed.discard(key)
                    return True
                return False
            self._counts["rejected"] += 1
            self.faults.record("over_budget", f"an entry of {len(blob)} bytes is larger than every tier: not stored")
            return False

    def get(self, key: str, *, promote: bool = True) -> bytes | None:
        """The blob under ``key``, or None (a miss: absent, or found corrupt / unreadable on disk and dropped).

        A disk hit is copied into the CPU tier when ``promote`` (which may evict other CPU entries to disk, and
        those may push disk entries out); ``promote=False`` reads without changing what either tier holds, which a
        caller loading several planned entries in a row needs so that one read never evicts the next.
        """
        _check_key(key)
        with self._lock:
            blob = self._cpu.get(key)
            if blob is not None:
                self._cpu.move_to_end(key)
                self._counts["hits"] += 1
                return blob
            if key in self._disk:
                blob = self._read_disk(key)
                if blob is not None:
                    self._counts["hits"] += 1
                    self._counts["disk_hits"] += 1
                    self._disk.move_to_end(key)
                    if promote and len(blob) <= self.cpu_budget:
                        self._cpu[key] = blob
                        self._cpu_used += len(blob)
                        self._shrink_cpu()
                    return blob
            self._counts["misses"] += 1
            return None

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held in a tier (does not read or verify disk files, does not count as a hit)."""
        _check_key(key)
        with self._lock:
            return key in self._cpu or key in self._disk

    __contains__ = contains

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier; returns whether it was held."""
        _check_key(key)
        with self._lock:
            return self._remove(key)

    def keys(self) -> list[str]:
        """Every held key (CPU tier first, least recently used first within a tier)."""
        with self._lock:
            return list(self._cpu) + [k for k in self._disk if k not in self._cpu]

    def __len__(self) -> int:
        return len(self.keys())

    def clear(self) -> None:
        """Remove every entry (and its disk file; in a shared directory, every entry this process has indexed)."""
        with self._lock:
            for key in self.keys():
                self._remove(key)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """``(added, removed)`` since the last call, after re-reading a shared directory if another process changed it.

        ``added``: keys other processes wrote to the directory (now held here too). ``removed``: keys that left
        every tier (evicted for room, found corrupt or vanished, deleted, or evicted by another process). A
        scheduler-side index applies both, so that a lookup offers only what a load will find.
        """
        with self._lock:
            if self.disk_dir is not None and self._generation_moved():
                try:
                    with self._dir_lock():
                        self._rescan()
                except OSError as exc:
                    self.faults.record_os(exc, "shared disk index not refreshed")
            added = sorted(k for k in self._added if k in self._cpu or k in self._disk)
            removed = sorted(k for k in self._removed if k not in self._cpu and k not in self._disk)
            self._added.clear()
            self._removed.clear()
            return added, removed

    @property
    def metrics(self) -> StoreMetrics:
        """A consistent snapshot of the counters and per-tier bytes."""
        with self._lock:
            faults = self.faults.counts()
            return StoreMetrics(
                **self._counts,
                corrupt=faults["fault_corrupt"],
                cpu_entries=len(self._cpu),
                cpu_bytes=self._cpu_used,
                disk_entries=len(self._disk),
                disk_bytes=self._disk_used,
                faults=faults,
            )

    # ---------------------------------------------------------------------------------------- cpu tier
    def _remove(self, key: str) -> bool:
        held = False
        blob = self._cpu.pop(key, None)
        if blob is not None:
            self._cpu_used -= len(blob)
            held = True
        if key in self._disk:
            try:
                with self._dir_lock():
                    self._drop_file(key)
            except OSError as exc:  # the file may stay behind; it is no longer ours to serve
                self.faults.record_os(exc, "a deleted entry's file could not be removed")
                self._forget_disk(key)
            held = True
        if held:
            self._removed.add(key)
        return held

    def _shrink_cpu(self) -> None:
        while self._cpu_used > self.cpu_budget:
            key, blob = self._cpu.popitem(last=False)
            self._cpu_used -= len(blob)
            # inclusive tiers: an entry already on disk needs no write
            if key in self._disk or (
                self.disk_dir is not None
                and self._fits_disk(self._file_size(key, blob))
                and self._write_disk_safely(key, blob, "entry evicted instead of spilled")
            ):
                self._counts["spills"] += 1
            else:
                self._counts["evictions"] += 1
                self._removed.add(key)

    # --------------------------------------------------------------------------------------- disk tier
    def _fits_disk(self, size: int) -> bool:
        return self.disk_budget is None or size <= self.disk_budget

    @staticmethod
    def _file_size(key: str, blob: bytes) -> int:
        return _HEADER.size + len(key.encode()) + len(blob) + _SUM

    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / (hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + _SUFFIX)

    @contextlib.contextmanager
    def _dir_lock(self) -> Iterator[None]:
        """Exclusive ``flock`` of the directory's lock file (re-entrant within this store; callers hold ``_lock``)."""
        assert self.disk_dir is not None
        if self._flock_depth == 0:
            fd = os.open(self.disk_dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._flock_fd = fd
        self._flock_depth += 1
        try:
            yield
        finally:
            self._flock_depth -= 1
            if self._flock_depth == 0 and self._flock_fd is not None:
                try:
                    if self._dir_changed:  # one announcement per locked operation, however many files it touched
                        self._dir_changed = False
                        self._bump_generation()
                finally:
                    fd, self._flock_fd = self._flock_fd, None
                    os.close(fd)  # closing the descriptor releases the flock

    def _read_generation(self) -> int:
        assert self.disk_dir is not None
        try:
            with open(self.disk_dir / _GEN_NAME, "rb") as f:
                raw = f.read(_GEN.size)
        except FileNotFoundError:
            return 0
        return _GEN.unpack(raw)[0] if len(raw) == _GEN.size else 0

    def _bump_generation(self) -> None:
        """On releasing the directory lock: announce this holder's changes to the other processes using it."""
        assert self.disk_dir is not None
        gen = self._read_generation() + 1
        fd = os.open(self.disk_dir / _GEN_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, _GEN.pack(gen), 0)
        finally:
            os.close(fd)
        if self._gen == gen - 1:  # nobody else changed it since we last looked: our index is current
            self._gen = gen

    def _generation_moved(self) -> bool:
        try:
            return self._read_generation() != self._gen
        except OSError:
            return True

    def _sync_under_lock(self) -> None:
        if self._generation_moved():
            self._rescan()

    def _write_disk_safely(self, key: str, blob: bytes, what: str) -> bool:
        try:
            with self._dir_lock():
                self._sync_under_lock()
                self._write_disk(key, blob)
        except OSError as exc:
            self.faults.record_os(exc, what)
            return False
        return True

    def _write_disk(self, key: str, blob: bytes) -> None:
        """Under the directory lock: evict for room, write atomically, index (the lock's release announces it)."""
        kb = key.encode()
        body = _HEADER.pack(_MAGIC, len(kb), len(blob)) + kb + blob
        data = body + hashlib.blake2b(body, digest_size=_SUM).digest()
        if key in self._disk:
            self._drop_file(key)
        if self.disk_budget is not None:
            while self._disk and self._disk_used + len(data) > self.disk_budget:
                old = next(iter(self._disk))
                self._drop_file(old)
                if old not in self._cpu:
                    self._counts["evictions"] += 1
                    self._removed.add(old)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.disk_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                Path(tmp).unlink(missing_ok=True)
            raise
        self._disk[key] = len(data)
        self._disk_used += len(data)
        self._dir_changed = True

    def _forget_disk(self, key: str) -> None:
        self._disk_used -= self._disk.pop(key)

    def _drop_file(self, key: str) -> None:
        """Under the directory lock: unlink ``key``'s file and un-index it."""
        self._forget_disk(key)
        self._dir_changed = True
        self._path(key).unlink(missing_ok=True)

    def _parse(self, data: bytes) -> tuple[str, bytes] | None:
        if len(data) < _HEADER.size + _SUM:
            return None
        magic, klen, blen = _HEADER.unpack_from(data)
        if magic != _MAGIC or len(data) != _HEADER.size + klen + blen + _SUM:
            return None
        body = data[:-_SUM]
        if hashlib.blake2b(body, digest_size=_SUM).digest() != data[-_SUM:]:
            return None
        try:
            key = body[_HEADER.size : _HEADER.size + klen].decode()
        except UnicodeDecodeError:
            return None
        return key, body[_HEADER.size + klen :]

    def _read_disk(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            kind = self.faults.record_os(exc, "a disk entry could not be read: served as a miss")
            self._drop_unusable(key, unlink=kind != "vanished")
            return None
        parsed = self._parse(data)
        if parsed is None or parsed[0] != key:
            self.faults.record("corrupt", "a disk entry failed its checksum: dropped and served as a miss")
            self._drop_unusable(key, unlink=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used across every process sharing the directory
        return parsed[1]

    def _drop_unusable(self, key: str, *, unlink: bool) -> None:
        """Un-index a disk entry that cannot be served (deleting its file when ``unlink``, best effort), so it is
        never offered again, and report it removed unless the CPU tier still holds it."""
        try:
            if not unlink:
                raise FileNotFoundError(key)
            with self._dir_lock():
                self._drop_file(key)
        except OSError:
            self._forget_disk(key)
        if key not in self._cpu:
            self._removed.add(key)

    def _rescan(self, *, startup: bool = False) -> None:
        """Under the directory lock: re-read the directory into the disk index (LRU order = file mtime).

        Entries of other processes are indexed (and reported as added); indexed entries whose file is gone are
        un-indexed (and reported as removed). At start-up, interrupted writes are deleted (every writer holds
        the lock while its temporary file exists) and the budget is enforced.
        """
        assert self.disk_dir is not None
        gen = self._read_generation()
        by_path = {self._path(k).name: k for k in self._disk}
        found = []
        for entry in os.scandir(self.disk_dir):
            if entry.name.startswith(_TMP_PREFIX):
                if startup:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                continue
            if not entry.name.endswith(_SUFFIX):
                continue
            try:
                st = entry.stat()
            except OSError:
                continue
            key = by_path.get(entry.name)
            if key is None:
                key = self._read_key(Path(entry.path))
                if key is None:
                    continue  # not ours: left alone; a damaged entry of ours is caught by its checksum on read
            found.append((st.st_mtime_ns, key, st.st_size))
        old = set(self._disk)
        self._disk = OrderedDict((key, size) for _, key, size in sorted(found))
        self._disk_used = sum(self._disk.values())
        for key in old - set(self._disk):
            if key not in self._cpu:
                self._removed.add(key)
        if not startup:
            self._added.update(set(self._disk) - old - set(self._cpu))
        self._gen = gen
        if startup and self.disk_budget is not None:
            while self._disk and self._disk_used > self.disk_budget:
                self._drop_file(next(iter(self._disk)))
                self._counts["evictions"] += 1

    def _read_key(self, path: Path) -> str | None:
        try:
            with path.open("rb") as f:
                magic, klen, _blen = _HEADER.unpack(f.read(_HEADER.size))
                key = f.read(klen).decode() if magic == _MAGIC else None
        except (struct.error, UnicodeDecodeError, OSError):
            return None
        if key is None or path.name != self._path(key).name:
            return None
        return key

    def __repr__(self) -> str:
        m = self.metrics
        disk = "" if self.disk_dir is None else f", disk {m.disk_bytes}/{self.disk_budget} bytes"
        return f"TieredStore(cpu {m.cpu_bytes}/{self.cpu_budget} bytes{disk}, {len(self)} entries)"
