"""Cache keys: one per full block of prompt tokens, derived from vLLM's own block hashes, under a namespace.

vLLM fingerprints every full block of a request with a hash chained over the prefix (``request.block_hashes``,
``vllm.v1.core.kv_cache_utils.hash_block_tokens``) that folds in everything vLLM's own prefix cache keys on: the
token ids, the LoRA adapter, multimodal input hashes, ``cache_salt`` and prompt-embedding hashes (and whatever a later
vLLM adds). A key here is ``blake2b(namespace digest || that block hash)``, so two requests share an entry exactly
when vLLM's prefix cache would share the block *and* the namespace matches: the model, the KV dtype, the KV shape on
this rank (KV heads and head size after tensor-parallel sharding), the block size, the stored record's layout, and
the codec's ``config_hash()`` (so a lossless entry is never read back by a KIVI-4 run, nor KIVI-4 by KIVI-2).
A request for which vLLM computed no block hashes is neither stored nor loaded (:func:`request_keys` returns None).

The paged layout of the attention backend is *not* part of the namespace: records are stored canonical,
token-major ``[block_size, kv_heads, head_dim]`` per layer (see :mod:`kv_vllm.layout`), so they load under any
supported backend. Block hashes are reproducible across processes and restarts with vLLM's default ``sha256``
(a fixed seed) or with ``PYTHONHASHSEED`` set; with a non-cryptographic hash and no seed each process gets its own
hashes, so entries of another process (or an earlier run) are simply never hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from kvcore.checks import check_int
from kvpages import namespace_digest

# Bumped when the block record format (kv_vllm.record) changes: old entries then never match.
RECORD_LAYOUT = "kv_vllm.record/1:[block_size,kv_heads,head_dim]"


def namespace(
    *,
    model: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    codec_hash: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    tag: str = "",
) -> dict[str, str]:
    """The namespace mapping of :func:`block_keys` (every value a string, as ``kvpages.chain_keys`` takes).

    Parameters
    ----------
    model : str
        Model name or path and revision, as vLLM was given it.
    dtype : str
        The KV cache dtype (``"float16"``, ``"bfloat16"``, ``"float32"``).
    num_kv_heads, head_size : int
        KV heads held by this rank and their size.
    block_size : int
        Tokens per block (a key covers exactly one block).
    codec_hash : str
        ``PageCodec.config_hash()`` of the codec that writes the entries.
    tp_rank, tp_size : int
        Tensor-parallel rank and world size (each rank stores its own heads).
    tag : str
        Free user namespace (e.g. a deployment name) to keep caches apart.
    """
    for name, value in (("model", model), ("dtype", dtype), ("codec_hash", codec_hash), ("tag", tag)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not model:
        raise ValueError("model must be a non-empty string")
    check_int("num_kv_heads", num_kv_heads, low=1)
    check_int("head_size", head_size, low=1)
    check_int("block_size", block_size, low=1)
    check_int("tp_size", tp_size, low=1)
    check_int("tp_rank", tp_rank, low=0, high=tp_size - 1)
    return {
        "engine": "vllm",
        "model": model,
        "dtype": dtype,
        "kv_shape": f"{num_kv_heads}x{head_size}",
        "block_size": str(block_size),
        "record": RECORD_LAYOUT,
        "codec": codec_hash,
        "tp": f"{tp_rank}/{tp_size}",
        "tag": tag,
    }


def request_keys(
    ns: Mapping[str, str], block_hashes: Sequence[bytes], num_blocks: int, hashes_per_block: int = 1
) -> list[str] | None:
    """Keys of a request's first ``num_blocks`` full blocks, from vLLM's block hashes; None when there are none.

    Parameters
    ----------
    ns : Mapping[str, str]
        The namespace (:func:`namespace`).
    block_hashes : sequence of bytes
        ``request.block_hashes``: one hash per ``hash_block_size`` tokens, each chained over the prefix.
    num_blocks : int
        Full KV blocks wanted.
    hashes_per_block : int
        ``block_size // hash_block_size`` (1 unless vLLM hashes at a finer grain): block ``i``'s key uses the hash
        that ends at its last token.

    Returns
    -------
    list of str or None
        One 64-hex-digit key per block, or None when vLLM gave fewer hashes than the blocks need (no block hasher,
        e.g. a vLLM without one for this request): the request is then neither stored nor loaded.
    """
    check_int("num_blocks", num_blocks, low=0)
    check_int("hashes_per_block", hashes_per_block, low=1)
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise TypeError(f"block_hashes must be a sequence of bytes, got {type(block_hashes).__name__}")
    if len(block_hashes) < num_blocks * hashes_per_block:
        return None
    digest = namespace_digest(ns)
    keys = []
    for i in range(num_blocks):
        h = block_hashes[(i + 1) * hashes_per_block - 1]
        if not isinstance(h, (bytes, bytearray)) or not h:
            raise TypeError(f"block_hashes[{(i + 1) * hashes_per_block - 1}] must be non-empty bytes, got {h!r}")
        keys.append(hashlib.blake2b(digest + bytes(h), digest_size=32).hexdigest())
    return keys
