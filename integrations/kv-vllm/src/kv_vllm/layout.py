"""Paged KV layouts of vLLM's attention backends: gather whole blocks out, scatter them back in.

Since vLLM 0.32 (RFC vllm-project/vllm#42082) every attention backend hands a connector the same *logical* per-layer
view ``kv_layer[num_blocks, num_kv_heads, block_size, content]`` (blocks first; the physical stride order may differ,
e.g. ``LBNHC`` on CUDA). What the ``content`` axis holds depends on the backend:

* ``"split_last"`` -- FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION: ``content = 2 * head_dim``, the key of a token in
  ``[..., :head_dim]`` and its value in ``[..., head_dim:]`` (their ``kv_cache.transpose(1, 2).split(head_size, -1)``).
* ``"cpu"`` -- CPU_ATTN: ``content = 2 * head_dim`` as well, but each (block, head) page is re-viewed as
  ``[2 * block_size, head_dim]``: the page's ``block_size`` keys come first, then its ``block_size`` values
  (``kv_cache.view(B, H, 2 * N, -1).chunk(2, dim=2)`` in ``cpu_attn.py``), so a page must be contiguous.

Everything stored is canonical: keys and values ``[blocks, block_size, kv_heads, head_dim]`` (token-major, KV-head
granularity), so an entry written under one backend's layout reads back under another's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = ("split_last", "cpu")

# vLLM backend name (AttentionBackend.get_name()) -> layout of its per-layer view.
BACKEND_LAYOUTS = {
    "CPU_ATTN": "cpu",
    "FLASH_ATTN": "split_last",
    "TRITON_ATTN": "split_last",
    "FLEX_ATTENTION": "split_last",
}


def check_layout(layout: object) -> str:
    """Return ``layout`` if it is one of :data:`LAYOUTS`, else raise ``ValueError``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout  # type: ignore[return-value]


def layout_for_backend(backend_name: str) -> str:
    """The layout of the per-layer view of a vLLM attention backend, by its ``get_name()``.

    Raises
    ------
    ValueError
        For a backend whose view is not documented here (FlashInfer's K/V page sides, MLA, quantized layouts):
        loading into an unknown layout would write wrong KV, so the connector refuses it up front.
    """
    if backend_name not in BACKEND_LAYOUTS:
        raise ValueError(
            f"attention backend {backend_name!r} has no supported paged layout; supported backends: "
            f"{sorted(BACKEND_LAYOUTS)} (or set kv_connector_extra_config layout to one of {list(LAYOUTS)})"
        )
    return BACKEND_LAYOUTS[backend_name]


def _check_view(kv_layer: object, layout: str) -> tuple[int, int, int, int]:
    check_layout(layout)
    if not isinstance(kv_layer, torch.Tensor):
        raise TypeError(f"kv_layer must be a torch.Tensor, got {type(kv_layer).__name__}")
    if kv_layer.ndim != 4:
        raise ValueError(
            f"kv_layer must be vLLM's per-layer view [num_blocks, kv_heads, block_size, 2 * head_dim], "
            f"got shape {tuple(kv_layer.shape)}"
        )
    B, H, N, C = kv_layer.shape
    if C % 2:
        raise ValueError(f"kv_layer's last axis holds keys and values (2 * head_dim), got odd size {C}")
    if layout == "cpu":
        page = kv_layer[0] if B else kv_layer.new_empty(H, N, C)
        if not page.is_contiguous():
            raise ValueError(
                f"the 'cpu' layout needs each (block, head) page contiguous (vLLM's LBHNC); got strides "
                f"{tuple(kv_layer.stride())} for shape {tuple(kv_layer.shape)}"
            )
    return B, H, N, C // 2


def page_shape(kv_layer: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """``(block_size, kv_heads, head_dim)``: the shape of one block's keys (or values) in canonical form."""
    _, H, N, D = _check_view(kv_layer, layout)
    return N, H, D


def _block_index(block_ids: Sequence[int] | torch.Tensor, num_blocks: int, device: torch.device) -> torch.Tensor:
    idx = torch.as_tensor(block_ids, dtype=torch.long)
    if idx.ndim != 1:
        raise ValueError(f"block_ids must be a flat sequence of block numbers, got shape {tuple(idx.shape)}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_blocks):
        raise ValueError(f"block_ids must be in [0, {num_blocks}), got {idx.tolist()}")
    return idx.to(device)


def gather_blocks(
    kv_layer: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy whole blocks out of one layer's paged view.

    Parameters
    ----------
    kv_layer : Tensor
        vLLM's per-layer view ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (any strides for
        ``"split_last"``; contiguous pages for ``"cpu"``).
    block_ids : sequence of int
        Blocks to read, in token order.
    layout : {"split_last", "cpu"}
        How keys and values share the ``content`` axis (module docstring).

    Returns
    -------
    keys, values : Tensor
        ``[len(block_ids), block_size, kv_heads, head_dim]`` each, new tensors on ``kv_layer``'s device and dtype.
    """
    _, H, N, D = _check_view(kv_layer, layout)
    idx = _block_index(block_ids, kv_layer.shape[0], kv_layer.device)
    pages = kv_layer.index_select(0, idx)  # [nb, H, N, 2D], a copy
    if layout == "split_last":
        keys, values = pages[..., :D], pages[..., D:]
    else:
        halves = pages.reshape(idx.numel(), H, 2, N, D)
        keys, values = halves[:, :, 0], halves[:, :, 1]
    return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def scatter_blocks(
    kv_layer: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: str,
) -> None:
    """Write whole blocks into one layer's paged view (the inverse of :func:`gather_blocks`).

    ``keys`` and ``values`` are ``[len(block_ids), block_size, kv_heads, head_dim]``; they are cast to the view's
    dtype and device. Every argument is checked before anything is written, and the write is a single indexed copy,
    so a call that raises leaves ``kv_layer`` untouched. Repeated block ids are refused (the result would depend on
    write order).
    """
    _, H, N, D = _check_view(kv_layer, layout)
    idx = _block_index(block_ids, kv_layer.shape[0], kv_layer.device)
    if idx.unique().numel() != idx.numel():
        raise ValueError(f"block_ids must not repeat, got {idx.tolist()}")
    want = (idx.numel(), N, H, D)
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != want:
            raise ValueError(
                f"{name} must have shape [blocks, block_size, kv_heads, head_dim] = {want}, got {tuple(x.shape)}"
            )
    k = keys.to(device=kv_layer.device, dtype=kv_layer.dtype).transpose(1, 2)  # [nb, H, N, D]
    v = values.to(device=kv_layer.device, dtype=kv_layer.dtype).transpose(1, 2)
    if layout == "split_last":
        pages = torch.cat([k, v], dim=-1)
    else:
        pages = torch.stack([k, v], dim=2).reshape(idx.numel(), H, N, 2 * D)
    kv_layer.index_copy_(0, idx, pages)
