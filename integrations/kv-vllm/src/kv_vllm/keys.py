"""Cache keys: one per full block of prompt tokens, chained over the prefix, under a namespace.

A key is :func:`kvpages.chain_keys` over the request's full blocks of token ids, with a namespace holding
everything else the stored bytes depend on: the model, the KV dtype, the KV shape on this rank (KV heads and
head size after tensor-parallel sharding), the block size, the stored record's layout, and the codec's
``config_hash()`` (so a lossless entry is never read back by a KIVI-4 run, nor KIVI-4 by KIVI-2).
The paged layout of the attention backend is *not* part of it: records are stored canonical, token-major
``[block_size, kv_heads, head_dim]`` per layer (see :mod:`kv_vllm.layout`), so they load under any supported
backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcore.checks import check_int
from kvpages import chain_keys

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


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Number of whole blocks in ``num_tokens`` tokens."""
    check_int("num_tokens", num_tokens, low=0)
    check_int("block_size", block_size, low=1)
    return num_tokens // block_size


def block_keys(
    ns: Mapping[str, str], token_ids: Sequence[int], block_size: int, num_blocks: int | None = None
) -> list[str]:
    """Keys of the first ``num_blocks`` full blocks of ``token_ids`` (all full blocks when None).

    The key of block ``i`` depends on the tokens of blocks ``0..i`` and on ``ns``; a trailing partial block gets
    no key (only whole blocks are stored).
    """
    n_full = full_blocks(len(token_ids), block_size)
    n = n_full if num_blocks is None else check_int("num_blocks", num_blocks, low=0, high=n_full)
    ids = list(token_ids[: n * block_size])
    return chain_keys(ns, [ids[i * block_size : (i + 1) * block_size] for i in range(n)])
