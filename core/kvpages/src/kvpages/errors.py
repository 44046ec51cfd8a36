"""Errors raised by kvpages."""

from __future__ import annotations


class CorruptEntry(ValueError):
    """A stored page blob is truncated, corrupted, or was written by another codec or format version.

    Readers treat it as a cache miss (the page is recomputed), never as data.
    """
