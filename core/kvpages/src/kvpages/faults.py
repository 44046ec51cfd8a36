"""Faults of a cache, counted by kind and logged once per kind.

A KV cache in a serving engine is best effort: a full disk, an I/O error, a file deleted or damaged under a running
engine, a page the codec cannot encode, an entry larger than every budget -- each must turn into "not stored" or
"recompute", never into an exception inside the engine's step and never into wrong KV. :class:`FaultLog` is where
the adapters and :class:`~kvpages.TieredStore` record such faults: one counter per kind (reported in the metrics)
and one warning per kind per log (later ones at debug level, so a failing disk does not flood the engine's log).
"""

from __future__ import annotations

import errno
import logging
import threading

# The kinds every kvpages component reports (metrics keys are ``fault_<kind>``).
FAULT_KINDS = (
    "disk_full",  # ENOSPC / EDQUOT / EFBIG: a write did not fit
    "io_error",  # EIO and other OS errors on read or write
    "permission",  # EACCES / EPERM / EROFS
    "vanished",  # a file indexed by this process was gone (deleted by another process or by hand)
    "corrupt",  # a blob failed its checksum, frame or table of contents
    "nonfinite",  # a page with NaN or inf offered to a lossy codec
    "over_budget",  # an entry larger than every tier's budget
    "codec",  # a page the codec refused for another reason
    "unexpected",  # anything else caught at an engine boundary (logged with its traceback once)
)


class NonFinitePage(ValueError):
    """A page holds NaN or inf and the codec is lossy (its scales would be meaningless): it is not stored."""


def os_fault_kind(exc: OSError) -> str:
    """The :data:`FAULT_KINDS` name of an ``OSError``: full disk, permission, vanished file, or I/O error."""
    if not isinstance(exc, OSError):
        raise TypeError(f"exc must be an OSError, got {type(exc).__name__}")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "disk_full"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    if exc.errno == errno.ENOENT:
        return "vanished"
    return "io_error"


class FaultLog:
    """Thread-safe fault counters by kind; the first fault of each kind is logged as a warning.

    Parameters
    ----------
    logger : logging.Logger
        Where the warnings go.
    owner : str
        Prefix of every message (e.g. ``"kv_vllm worker"``).
    """

    def __init__(self, logger: logging.Logger, owner: str):
        if not isinstance(logger, logging.Logger):
            raise TypeError(f"logger must be a logging.Logger, got {type(logger).__name__}")
        if not isinstance(owner, str) or not owner:
            raise TypeError(f"owner must be a non-empty str, got {owner!r}")
        self._logger = logger
        self._owner = owner
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FAULT_KINDS, 0)

    def record(self, kind: str, what: str, exc: BaseException | None = None) -> None:
        """Count one fault of ``kind`` (one of :data:`FAULT_KINDS`) and log it if it is the first of its kind.

        ``what`` says what was lost ("block entry not stored", "load recomputed"); ``exc`` is the cause.
        """
        if kind not in self._counts:
            raise ValueError(f"kind must be one of {list(FAULT_KINDS)}, got {kind!r}")
        with self._lock:
            self._counts[kind] += 1
            first = self._counts[kind] == 1
        cause = "" if exc is None else f": {type(exc).__name__}: {exc}"
        if first:
            self._logger.warning(
                "%s: %s (%s)%s -- counted in the metrics as fault_%s; later faults of this kind are logged at debug",
                self._owner,
                what,
                kind,
                cause,
                kind,
                exc_info=exc if kind == "unexpected" else None,
            )
        else:
            self._logger.debug("%s: %s (%s)%s", self._owner, what, kind, cause)

    def record_os(self, exc: OSError, what: str) -> str:
        """:meth:`record` an ``OSError`` under its :func:`os_fault_kind`; returns the kind."""
        kind = os_fault_kind(exc)
        self.record(kind, what, exc)
        return kind

    def counts(self) -> dict[str, int]:
        """Faults so far by kind, as ``{"fault_<kind>": n}`` for every kind (zeros included)."""
        with self._lock:
            return {f"fault_{k}": v for k, v in self._counts.items()}

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
