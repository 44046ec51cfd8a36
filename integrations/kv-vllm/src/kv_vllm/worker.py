"""Worker-side data path of the connector, free of vLLM types: paged tensors in, encoded entries out, and back.

Save: after each layer's attention, :meth:`WorkerState.save_layer` gathers the planned blocks from the layer's
paged view and encodes each block's page with the codec; :meth:`WorkerState.flush` (vLLM's ``wait_for_save``)
packs every layer's page of a block into one entry and puts it in the :class:`kvpages.TieredStore`.
Load: :meth:`WorkerState.load` reads each planned block's entry, decodes every layer and scatters the blocks into
the allocated vLLM blocks; a missing, truncated or corrupt entry fails that block and every later block of the
request (vLLM recomputes from the first failed block), and nothing of a failed block is written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

import kvpages

from . import record
from .layout import gather_blocks, page_shape, scatter_blocks
from .scheduler import BlockTransfer


@dataclass
class WorkerMetrics:
    """What the worker moved: blocks, bytes stored vs the same KV in fp16, and codec time."""

    saved_blocks: int = 0
    loaded_blocks: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    stored_bytes: int = 0
    fp16_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0

    @property
    def compression(self) -> float:
        """fp16 bytes per stored byte over everything saved (0 before the first save)."""
        return self.fp16_bytes / self.stored_bytes if self.stored_bytes else 0.0

    def as_dict(self) -> dict[str, float]:
        out = dict(self.__dict__)
        out["compression"] = self.compression
        return out


class WorkerState:
    """Encode/decode blocks between vLLM's paged layers and a :class:`kvpages.TieredStore`.

    Parameters
    ----------
    codec : kvpages.PageCodec
        Encodes one layer's block ``[block_size, kv_heads, head_dim]``.
    store : kvpages.TieredStore
        Where the entries live (CPU LRU byte budget, optional disk tier).
    layout : str or None
        Paged layout of the layer views (:mod:`kv_vllm.layout`); None to resolve it later
        (:meth:`set_layout`, e.g. from the attention backend).
    """

    def __init__(self, codec: kvpages.PageCodec, store: kvpages.TieredStore, layout: str | None):
        self.codec = codec
        self.codec_hash = codec.config_hash()
        self.store = store
        self.layout = layout
        self.metrics = WorkerMetrics()
        self._pending: dict[str, dict[str, bytes]] = {}  # key -> layer -> encoded page
        self._pending_fp16: dict[str, int] = {}
        self._stored: list[str] = []
        self._missing: list[str] = []

    # ---------------------------------------------------------------------------------------------- save
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, saves: Sequence[BlockTransfer]) -> None:
        """Gather and encode one layer's page of every planned block (kept until :meth:`flush`)."""
        if not saves:
            return
        keys, values = gather_blocks(kv_layer, [t.block_id for t in saves], self._layout())
        fp16 = self.codec.fp16_bytes(*keys.shape[1:])
        start = time.perf_counter()
        for i, transfer in enumerate(saves):
            blob = self.codec.encode(keys[i], values[i])
            self._pending.setdefault(transfer.key, {})[layer_name] = blob
            self._pending_fp16[transfer.key] = self._pending_fp16.get(transfer.key, 0) + fp16
        self.metrics.encode_s += time.perf_counter() - start

    def flush(self) -> list[str]:
        """Store the blocks encoded since the last flush, one entry per block; returns their keys."""
        stored = []
        for key, layers in self._pending.items():
            entry = record.pack(layers, self.codec_hash)
            self.store.put(key, entry)
            if self.store.contains(key):  # a block larger than both budgets is rejected by the store
                stored.append(key)
                self.metrics.saved_blocks += 1
                self.metrics.stored_bytes += len(entry)
                self.metrics.fp16_bytes += self._pending_fp16[key]
        self._pending = {}
        self._pending_fp16 = {}
        self._stored.extend(stored)
        return stored

    # ---------------------------------------------------------------------------------------------- load
    def load(self, layers: Mapping[str, torch.Tensor], loads: Mapping[str, Sequence[BlockTransfer]]) -> set[int]:
        """Load the planned blocks of every request into ``layers`` (layer name -> paged view).

        Returns the vLLM block ids that failed: for each request, its first block whose entry is missing, corrupt,
        or lacks a layer, and every block after it. Blocks that loaded are scattered into every layer; failed
        blocks are left untouched for vLLM to recompute.
        """
        failed: set[int] = set()
        good: list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = []
        layout = self._layout()
        for transfers in loads.values():
            for j, transfer in enumerate(transfers):
                pages = self._read(transfer.key, layers)
                if pages is None:
                    self._missing.append(transfer.key)
                    failed.update(t.block_id for t in transfers[j:])
                    break
                good.append((transfer.block_id, pages))
        if good:
            block_ids = [block_id for block_id, _ in good]
            for name, kv_layer in layers.items():
                keys = torch.stack([pages[name][0] for _, pages in good])
                values = torch.stack([pages[name][1] for _, pages in good])
                scatter_blocks(kv_layer, block_ids, keys, values, layout)
            self.metrics.loaded_blocks += len(good)
        return failed

    def _read(
        self, key: str, layers: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        entry = self.store.get(key)
        if entry is None:
            self.metrics.misses += 1
            return None
        start = time.perf_counter()
        try:
            blobs = record.unpack(entry, self.codec_hash)
            absent = sorted(set(layers) - set(blobs))
            if absent:
                raise kvpages.CorruptEntry(f"entry lacks layers {absent}")
            pages = {}
            for name, kv_layer in layers.items():
                k, v = self.codec.decode(blobs[name], device=kv_layer.device)
                want = page_shape(kv_layer, self._layout())
                if tuple(k.shape) != want or tuple(v.shape) != want:
                    raise kvpages.CorruptEntry(f"layer {name!r}: stored page {tuple(k.shape)}, layer needs {want}")
                pages[name] = (k, v)
        except kvpages.CorruptEntry:
            self.metrics.corrupt += 1
            self.store.delete(key)
            return None
        finally:
            self.metrics.decode_s += time.perf_counter() - start
        self.metrics.hits += 1
        return pages

    # -------------------------------------------------------------------------------------------- report
    def take_report(self) -> tuple[list[str], list[str]]:
        """Keys stored and keys found missing since the last call (sent to the scheduler)."""
        stored, missing = self._stored, self._missing
        self._stored, self._missing = [], []
        return stored, missing

    def announce_existing(self) -> None:
        """Queue every key already in the store (e.g. disk entries from an earlier run) for the next report."""
        self._stored.extend(self.store.keys())

    def set_layout(self, layout: str) -> None:
        self.layout = layout

    def _layout(self) -> str:
        if self.layout is None:
            raise RuntimeError("the paged layout is not resolved yet (set_layout or a layout in the config)")
        return self.layout
