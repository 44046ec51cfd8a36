"""Prefix key chains: one key per block of token ids, each depending on every block before it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np


def namespace_digest(namespace: Mapping[str, str]) -> bytes:
    """Digest of a namespace mapping (model, dtype, layout, codec hash, ...), independent of key order."""
    if not isinstance(namespace, Mapping):
        raise TypeError(f"namespace must be a mapping of str to str, got {type(namespace).__name__}")
    for k, v in namespace.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"namespace must map str to str, got {k!r}: {v!r}")
    return hashlib.blake2b(json.dumps(dict(namespace), sort_keys=True).encode(), digest_size=32).digest()


def chain_keys(namespace: Mapping[str, str], token_blocks: Sequence[Sequence[int]]) -> list[str]:
    """One hex key (64 digits) per block: ``key_i = H(key_{i-1} || H(namespace) || len || token ids of block i)``.

    The same tokens under another model, dtype, layout or codec (the ``namespace``) give other keys, and a block's
    key identifies its whole prefix, so a hit on block ``i`` implies the same tokens in blocks ``0..i``.

    Parameters
    ----------
    namespace : Mapping[str, str]
        What the stored bytes depend on besides the tokens; include the codec's ``config_hash()``.
    token_blocks : sequence of sequences of int
        Token ids, one sequence per block (blocks may be partial; ids in the int64 range).
    """
    ns = namespace_digest(namespace)
    if isinstance(token_blocks, (str, bytes)) or not isinstance(token_blocks, Sequence):
        raise TypeError(f"token_blocks must be a sequence of sequences of int, got {type(token_blocks).__name__}")
    keys, prev = [], b""
    for i, block in enumerate(token_blocks):
        if isinstance(block, (str, bytes)) or not isinstance(block, (Sequence, np.ndarray)):
            raise TypeError(f"token_blocks[{i}] must be a sequence of int, got {type(block).__name__}")
        for t in block:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"token_blocks[{i}] must hold ints, got {type(t).__name__}")
        try:
            ids = np.asarray(block, dtype=np.int64).tobytes()
        except OverflowError:
            raise ValueError(f"token_blocks[{i}] holds a token id outside the int64 range") from None
        h = hashlib.blake2b(digest_size=32)
        h.update(prev)
        h.update(ns)
        h.update(len(block).to_bytes(8, "little"))
        h.update(ids)
        prev = h.digest()
        keys.append(prev.hex())
    return keys
