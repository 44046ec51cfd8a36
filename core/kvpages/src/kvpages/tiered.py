"""A thread-safe, byte-budgeted LRU store of blobs: CPU memory first, an optional disk directory second."""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

_MAGIC = b"KVPE"
_HEADER = struct.Struct("<4sIQ")  # magic, key length, blob length
_SUM = 16
_SUFFIX = ".kvp"
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class StoreMetrics:
    """A snapshot of a :class:`TieredStore`'s counters.

    ``hits``/``misses`` count :meth:`TieredStore.get` calls (``disk_hits`` of the hits came from disk);
    ``corrupt`` counts entries found damaged and dropped; ``evictions`` counts entries that left the store for
    lack of room (``spills`` counts moves from CPU to disk, which are not evictions); ``rejected`` counts puts
    larger than every tier. ``cpu_bytes``/``disk_bytes`` are the bytes held per tier (disk: file sizes).
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

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _check_budget(name: str, value: object, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        allowed = "an int >= 0 or None" if optional else "an int >= 0"
        raise ValueError(f"{name} must be {allowed} (bytes), got {value!r}")
    return value


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
        An existing, writable directory for the second tier. Entries already there (from an earlier process)
        are indexed at creation. Without it, entries evicted from the CPU tier are dropped.
    disk_bytes : int, optional
        Budget of the disk tier (sum of file sizes); None is unbounded. Only with ``disk_dir``.

    Notes
    -----
    * The tiers are inclusive: a disk hit is copied back to the CPU tier and its file kept, so evicting it from
      the CPU again costs no write. :meth:`put` replaces an existing entry in both tiers.
    * Disk files hold the key, the blob and a blake2b checksum, and are written to a temporary file then renamed
      (atomic on POSIX): a crash never leaves a partial entry under a real name. A file that fails its check is
      deleted, counted in ``metrics.corrupt``, and read as a miss.
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
        self._lock = threading.RLock()
        self._cpu: OrderedDict[str, bytes] = OrderedDict()
        self._cpu_used = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU order
        self._disk_used = 0
        self._counts = dict.fromkeys(("hits", "disk_hits", "misses", "corrupt", "evictions", "spills", "rejected"), 0)
        if self.disk_dir is not None:
            self._index_disk()

    # ----------------------------------------------------------------------------------------------- public API
    def put(self, key: str, blob: bytes | bytearray | memoryview) -> None:
        """Store ``blob`` under ``key`` (replacing any entry), evicting least recently used entries for room."""
        _check_key(key)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"blob must be bytes, got {type(blob).__name__}")
        blob = bytes(blob)
        with self._lock:
            self._remove(key)
            if len(blob) <= self.cpu_budget:
                self._cpu[key] = blob
                self._cpu_used += len(blob)
                self._shrink_cpu()
            elif self.disk_dir is not None and self._fits_disk(self._file_size(key, blob)):
                self._write_disk(key, blob)
            else:
                self._counts["rejected"] += 1

    def get(self, key: str) -> bytes | None:
        """The blob under ``key``, or None (a miss: absent, or found corrupt on disk and dropped)."""
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
                    if len(blob) <= self.cpu_budget:
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
        """Remove every entry (and its disk file)."""
        with self._lock:
            for key in self.keys():
                self._remove(key)

    @property
    def metrics(self) -> StoreMetrics:
        """A consistent snapshot of the counters and per-tier bytes."""
        with self._lock:
            return StoreMetrics(
                **self._counts,
                cpu_entries=len(self._cpu),
                cpu_bytes=self._cpu_used,
                disk_entries=len(self._disk),
                disk_bytes=self._disk_used,
            )

    # ------------------------------------------------------------------------------------------------ internals
    def _remove(self, key: str) -> bool:
        held = False
        blob = self._cpu.pop(key, None)
        if blob is not None:
            self._cpu_used -= len(blob)
            held = True
        if key in self._disk:
            self._drop_file(key)
            held = True
        return held

    def _shrink_cpu(self) -> None:
        while self._cpu_used > self.cpu_budget:
            key, blob = self._cpu.popitem(last=False)
            self._cpu_used -= len(blob)
            # inclusive tiers: an entry already on disk needs no write
            if key in self._disk or (
                self.disk_dir is not None and self._fits_disk(self._file_size(key, blob)) and self._spill(key, blob)
            ):
                self._counts["spills"] += 1
            else:
                self._counts["evictions"] += 1

    def _spill(self, key: str, blob: bytes) -> bool:
        try:
            self._write_disk(key, blob)
        except OSError:  # a full or failing disk loses a cache entry, never the caller's request
            return False
        return True

    def _fits_disk(self, size: int) -> bool:
        return self.disk_budget is None or size <= self.disk_budget

    @staticmethod
    def _file_size(key: str, blob: bytes) -> int:
        return _HEADER.size + len(key.encode()) + len(blob) + _SUM

    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / (hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + _SUFFIX)

    def _write_disk(self, key: str, blob: bytes) -> None:
        kb = key.encode()
        body = _HEADER.pack(_MAGIC, len(kb), len(blob)) + kb + blob
        data = body + hashlib.blake2b(body, digest_size=_SUM).digest()
        if self.disk_budget is not None:
            while self._disk and self._disk_used + len(data) > self.disk_budget:
                old = next(iter(self._disk))
                self._drop_file(old)
                if old not in self._cpu:
                    self._counts["evictions"] += 1
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.disk_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._disk[key] = len(data)
        self._disk_used += len(data)

    def _drop_file(self, key: str) -> None:
        self._disk_used -= self._disk.pop(key)
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
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            data = b""
        parsed = self._parse(data)
        if parsed is None or parsed[0] != key:
            self._counts["corrupt"] += 1
            self._drop_file(key)
            return None
        return parsed[1]

    def _index_disk(self) -> None:
        assert self.disk_dir is not None
        found = []
        for path in self.disk_dir.iterdir():
            if path.name.startswith(_TMP_PREFIX):
                path.unlink(missing_ok=True)  # an interrupted write
                continue
            if path.suffix != _SUFFIX or not path.is_file():
                continue
            try:
                with path.open("rb") as f:
                    head = f.read(_HEADER.size)
                    magic, klen, _blen = _HEADER.unpack(head)
                    key = f.read(klen).decode() if magic == _MAGIC else None
                st = path.stat()
            except (struct.error, UnicodeDecodeError, OSError):
                key = None
            if key is None or path != self._path(key):
                continue  # not ours: left alone; a damaged entry of ours is caught by its checksum on read
            found.append((st.st_mtime_ns, key, st.st_size))
        for _mtime, key, size in sorted(found):
            self._disk[key] = size
            self._disk_used += size
        if self.disk_budget is not None:
            while self._disk and self._disk_used > self.disk_budget:
                self._drop_file(next(iter(self._disk)))
                self._counts["evictions"] += 1

    def __repr__(self) -> str:
        m = self.metrics
        disk = "" if self.disk_dir is None else f", disk {m.disk_bytes}/{self.disk_budget} bytes"
        return f"TieredStore(cpu {m.cpu_bytes}/{self.cpu_budget} bytes{disk}, {len(self)} entries)"
