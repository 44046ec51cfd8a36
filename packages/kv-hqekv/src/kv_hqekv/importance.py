"""Window importance (HqeKV §3.2, Alg. 2 l.5-9): attention of the last ``m`` queries, reduced over heads.

``A[b, j] = Σ_i Σ_{h ∈ Hq} softmax_j(q_i·k_j/√d + causal mask)`` over the ``m`` window queries ``i``, computed in
float32, divided by ``c_j = min(m, N - j)``, the number of window queries that see token ``j`` (the authors' code;
the paper's "cumulative" attention is the plain sum, ``normalize=False``). Query ``i`` of the window sits at column
``N - m + i`` of the keys and sees the columns up to its own.

:func:`window_importance` runs the tiled Triton kernel on CUDA (:mod:`kv_hqekv.kernels.triton_importance`: two
passes over key tiles, never more than a tile of the ``m × N`` probabilities) and :func:`window_importance_ref` on
CPU, which materialises the ``[B, Hq, m, N]`` probabilities (``m = 20``: 80 bytes per key and query head).
:func:`window_importance_blocked` is the same over the keys a store holds in a block layout
(:mod:`kv_hqekv.kernels.blocked`): on CUDA each key is dequantized in registers from its tier, so a re-plan never
writes the held keys out.
"""

from __future__ import annotations

import torch

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout, expand_side
from kv_hqekv.kernels.reference import dequantize_side_ref, seen_by
from kvcodec.kernels.dispatch import use_triton


def window_importance_ref(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None, normalize: bool = True
) -> torch.Tensor:
    """PyTorch reference of :func:`window_importance` (the CPU path).

    Parameters
    ----------
    queries : Tensor
        ``[B, Hq, m, D]`` post-RoPE window queries (the last ``m`` tokens), ``Hq`` a multiple of ``Hkv``.
    keys : Tensor
        ``[B, Hkv, N, D]`` post-RoPE keys, ``N >= m``.
    valid : Tensor, optional
        ``[B, N]`` bool, False on padding (excluded from the softmax; importance 0).
    normalize : bool
        Divide by ``c_j``.

    Returns
    -------
    Tensor
        float32 ``[B, N]``: per batch row, summed over query heads and window queries.
    """
    B, Hq, m, D = queries.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    q = queries.float().view(B, Hkv, g, m, D)
    logits = torch.einsum("bhgmd,bhnd->bhgmn", q, keys.float()) / D**0.5
    col = torch.arange(N, device=keys.device)
    row = N - m + torch.arange(m, device=keys.device)
    mask = col[None, :] <= row[:, None]  # [m, N] causal
    mask = mask[None] if valid is None else mask[None] & valid[:, None, :]  # [1 or B, m, N]
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a query seeing nothing (all padding) adds nothing
    a = p.sum(dim=(1, 2, 3))  # [B, N]
    if normalize:
        a = a / seen_by(N, m, keys.device)
    return a


def window_importance(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None, normalize: bool = True
) -> torch.Tensor:
    """Window importance ``A [B, N]`` (module doc); the Triton kernel on CUDA, the reference otherwise.

    Arguments are checked by the caller (:class:`~kv_hqekv.HqeKVScorer`); see :func:`window_importance_ref`.
    """
    if use_triton(keys):
        from kv_hqekv.kernels.triton_importance import window_importance_triton

        return window_importance_triton(queries, keys, valid, normalize)
    return window_importance_ref(queries, keys, valid, normalize)


def window_importance_blocked_ref(
    queries: torch.Tensor,
    layout: BlockLayout,
    keys: BlockedSide,
    valid: torch.Tensor | None = None,
    normalize: bool = True,
) -> torch.Tensor:
    """:func:`window_importance_ref` over the keys of a block layout (dequantized in the cache dtype, as
    ``HqeKVStore.read()`` gives them): ``A [B, N]`` with ``N = layout.width``."""
    return window_importance_ref(queries, dequantize_side_ref(expand_side(layout, keys)), valid, normalize)


def window_importance_blocked(
    queries: torch.Tensor,
    layout: BlockLayout,
    keys: BlockedSide,
    valid: torch.Tensor | None = None,
    normalize: bool = True,
) -> torch.Tensor:
    """Window importance over the held keys of a block layout (module doc); the Triton kernel on CUDA, the
    reference otherwise. ``layout`` and ``keys`` as ``HqeKVStore.decode_layout()`` returns them; ``queries`` and
    ``valid`` as in :func:`window_importance_ref` (``N = layout.width``)."""
    if not isinstance(layout, BlockLayout) or not isinstance(keys, BlockedSide):
        raise TypeError("layout and keys must be a BlockLayout and a BlockedSide (HqeKVStore.decode_layout())")
    B, H = layout.blocks.shape
    if not isinstance(queries, torch.Tensor) or queries.ndim != 4 or queries.shape[0] != B or queries.shape[1] % H:
        raise ValueError(f"queries must be [B={B}, Hq, m, D] with Hq a multiple of Hkv={H}")
    if queries.shape[3] != keys.head_dim or queries.shape[2] > layout.width:
        raise ValueError(f"queries must have head dim {keys.head_dim} and at most {layout.width} window rows")
    if valid is not None and tuple(valid.shape) != (B, layout.width):
        raise ValueError(f"valid must be [B={B}, N={layout.width}], got {tuple(valid.shape)}")
    if use_triton(queries):
        from kv_hqekv.kernels.triton_importance import window_importance_blocked_triton

        return window_importance_blocked_triton(queries, layout, keys, valid, normalize)
    return window_importance_blocked_ref(queries, layout, keys, valid, normalize)
