"""A stand-in for vLLM's block hasher in tests that run without vLLM (the engine tests use the real one).

Mirrors ``vllm.v1.core.kv_cache_utils.hash_block_tokens``: each full block's hash is chained over the previous
block's hash, the block's token ids and its "extra keys" (LoRA name, multimodal hashes, cache_salt, ...).
"""

from __future__ import annotations

import hashlib
import pickle


def block_hashes(tokens: list[int], block_size: int, extra: object = None) -> list[bytes]:
    """One hash per full block of ``tokens``; ``extra`` is folded into every block (vLLM folds cache_salt into the
    first block only and LoRA into every block; either way the chain carries it to every later block)."""
    out, prev = [], b"none-hash"
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        prev = hashlib.sha256(pickle.dumps((prev, block, extra))).digest()
        out.append(prev)
    return out
