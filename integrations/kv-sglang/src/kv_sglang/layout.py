"""SGLang's MHA host-pool page layouts, and their conversion to a layout-free page ``[tokens, layers*heads, dim]``.

SGLang's ``MHATokenToKVPoolHost.kv_buffer`` (0.5.23, ``mem_cache/pool_host/mha.py``):

=====================  ==========================================================
``layer_first``        ``[2, layers, tokens, heads, head_dim]``
``page_first``         ``[2, tokens, layers, heads, head_dim]``
``page_first_direct``  ``[2, pages, layers, page_size, heads, head_dim]``
=====================  ==========================================================

``get_data_page(index, flat=True)`` flattens that layout's slice of one page, and ``set_from_flat_data_page``
reads the same order back. Pages are stored layout-free: keys and values each ``[page_size, layers*heads,
head_dim]``, so KIVI's per-channel key groups run over the page's tokens for each (layer, head, channel), and a page
written from one layout loads into another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.checks import check_int

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PageGeometry:
    """Shape of one host-pool page: ``layout``, ``layers``, ``page_size`` tokens, ``heads`` KV heads, ``head_dim``."""

    layout: str
    layers: int
    page_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise NotImplementedError(f"host pool layout {self.layout!r} is not supported; supported: {LAYOUTS}")
        for name in ("layers", "page_size", "heads", "head_dim"):
            v = getattr(self, name)
            check_int(name, v, low=1)
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise NotImplementedError(f"host pool dtype {self.dtype} is not supported (fp16, bf16 or fp32 only)")

    @classmethod
    def of_pool(cls, pool: object) -> PageGeometry:
        """Geometry of an SGLang MHA host pool (``MHATokenToKVPoolHost``); other pools (MLA, hybrid) are refused."""
        needed = ("layout", "layer_num", "page_size", "head_num", "head_dim", "v_head_dim", "dtype", "kv_buffer")
        missing = [a for a in needed if a not in dir(pool)]
        if missing:
            raise NotImplementedError(
                f"{type(pool).__name__} is not an MHA host pool (missing {missing}); kv_sglang supports "
                "MHATokenToKVPoolHost only (no MLA or hybrid pools yet)"
            )
        if pool.v_head_dim != pool.head_dim:
            raise NotImplementedError(f"head_dim {pool.head_dim} != v_head_dim {pool.v_head_dim} is not supported")
        return cls(pool.layout, pool.layer_num, pool.page_size, pool.head_num, pool.head_dim, pool.dtype)

    @property
    def page_elements(self) -> int:
        """Elements of one page (keys and values)."""
        return 2 * self.layers * self.page_size * self.heads * self.head_dim

    def namespace(self) -> dict[str, str]:
        """What stored pages depend on (the layout is not part of it: pages are stored layout-free)."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "layers": str(self.layers),
            "page_size": str(self.page_size),
            "heads": str(self.heads),
            "head_dim": str(self.head_dim),
        }

    # -------------------------------------------------------------------------------- one page in the host layout
    def _page_shape(self) -> tuple[int, ...]:
        L, P, H, D = self.layers, self.page_size, self.heads, self.head_dim
        return (2, P, L, H, D) if self.layout == "page_first" else (2, L, P, H, D)

    def to_kv(self, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A page in this layout (flat, or a host-buffer slice) -> keys, values ``[P, L*H, D]`` (views if possible)."""
        x = page.reshape(self._page_shape())
        if self.layout != "page_first":
            x = x.transpose(1, 2)  # [2, P, L, H, D]
        k, v = x[0], x[1]
        P, L, H, D = k.shape
        return k.reshape(P, L * H, D), v.reshape(P, L * H, D)

    def from_kv(self, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write keys, values ``[P, L*H, D]`` into ``out``, a page in this layout (flat or the host buffer's slice)."""
        expect = (self.page_size, self.layers * self.heads, self.head_dim)
        if tuple(keys.shape) != expect or tuple(values.shape) != expect:
            raise ValueError(f"page keys/values must be {expect}, got {tuple(keys.shape)} / {tuple(values.shape)}")
        if out.numel() != self.page_elements:
            raise ValueError(f"target page holds {out.numel()} elements, expected {self.page_elements}")
        view = out.view(self._page_shape())  # raises if out cannot be viewed (never a silent copy)
        if self.layout != "page_first":
            view = view.transpose(1, 2)
        P, L, H, D = self.page_size, self.layers, self.heads, self.head_dim
        view[0].copy_(keys.reshape(P, L, H, D))
        view[1].copy_(values.reshape(P, L, H, D))

    def host_page(self, kv_buffer: torch.Tensor, index: int) -> torch.Tensor:
        """The slice of a host ``kv_buffer`` holding the page that starts at token ``index``."""
        P = self.page_size
        if index % P:
            raise ValueError(f"host index {index} is not page aligned (page_size {P})")
        if self.layout == "layer_first":
            return kv_buffer[:, :, index : index + P]
        if self.layout == "page_first":
            return kv_buffer[:, index : index + P]
        return kv_buffer[:, index // P]
