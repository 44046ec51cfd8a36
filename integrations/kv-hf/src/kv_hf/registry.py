"""Entry-point registry of kv-hf (group ``kvcompress.methods``).

kv-hf registers no method of its own: KVzip's scorer and compressor live in ``kv_baselines`` (the adapter only
provides the ``"kvzip_scores"`` extra through :mod:`kv_hf.providers`), and kv-hf never imports a method package.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcore import Compressor

METHODS: dict[str, Callable[[float], Compressor]] = {}
