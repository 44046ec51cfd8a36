"""Worker-side data path of the connector, free of vLLM types: paged tensors in, encoded entries out, and back.

Save: after each layer's attention, :meth:`WorkerState.save_layer` gathers the planned blocks from the layer's
paged view and encodes each block's page with the codec; :meth:`WorkerState.flush` (vLLM's ``wait_for_save``)
packs every layer's page of a block into one entry and puts it in the :class:`kvpages.TieredStore`.
Load: :meth:`WorkerState.load` reads each planned block's entry, decodes every layer and scatters the blocks into
the allocated vLLM blocks; a missing, truncated, corrupt or unreadable entry fails that block and every later block
of the request (vLLM recomputes from the first failed block), and nothing of a failed block is written.

Faults never escape: a page the codec cannot encode (NaN/inf under a lossy codec), an entry over every budget, a
full disk or an I/O error on save make the block "not stored"; any fault on load makes it "recompute". Each is
counted by kind (``fault_<kind>`` in :attr:`WorkerState.metrics`, the store's own faults included) and logged once
per kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

import kvpages

from . import record
from .layout import gather_blocks, page_shape, scatter_blocks
from .scheduler import BlockTransfer

logger = logging.getLogger(__name__)


@dataclass
class WorkerMetrics(kvpages.ByteCounts):
    """What the worker moved: blocks, bytes stored vs the same KV in fp16, codec time, and what failed.

    ``saved_blocks`` / ``stored_bytes`` count entries the store accepted; ``not_stored`` counts planned saves that
    were dropped (a fault of the codec or the store); ``loaded_blocks`` / ``hits`` count blocks loaded;
    ``misses`` loads that found no entry; ``corrupt`` entries that failed their checks; ``failed_loads`` every
    planned block reported failed to vLLM (including the blocks after a request's first failure).
    """

    saved_blocks: int = 0
    not_stored: int = 0
    loaded_blocks: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    failed_loads: int = 0
    stored_bytes: int = 0
    fp16_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, **self.byte_summary()}


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
    layers : sequence of str, optional
        Every attention layer a block entry must hold; an entry missing one is not stored. None: whatever layers
        were saved this step.
    """

    def __init__(
        self,
        codec: kvpages.PageCodec,
        store: kvpages.TieredStore,
        layout: str | None,
        layers: Sequence[str] | None = None,
    ):
        self.codec = codec
        self.codec_hash = codec.config_hash()
        self.store = store
        self.layout = layout
        self.layers = None if layers is None else tuple(layers)
        self.metrics = WorkerMetrics()
        self.faults = kvpages.FaultLog(logger, "kv_vllm worker")
        self._pending: dict[str, dict[str, bytes]] = {}  # key -> layer -> encoded page
        self._pending_fp16: dict[str, int] = {}
        self._poisoned: set[str] = set()  # keys a layer failed to encode this step: not stored
        self._stored: list[str] = []
        self._failed: list[str] = []

    # ---------------------------------------------------------------------------------------------- save
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, saves: Sequence[BlockTransfer]) -> None:
        """Gather and encode one layer's page of every planned block (kept until :meth:`flush`)."""
        if not saves:
            return
        keys, values = gather_blocks(kv_layer, [t.block_id for t in saves], self._layout())
        fp16 = self.codec.fp16_bytes(*keys.shape[1:])
        start = time.perf_counter()
        for i, transfer in enumerate(saves):
            if transfer.key in self._poisoned:
                continue
            try:
                blob = self.codec.encode(keys[i], values[i])
            except kvpages.NonFinitePage as exc:
                self._poison(transfer.key, "nonfinite", exc)
                continue
            except (ValueError, TypeError, RuntimeError) as exc:
                self._poison(transfer.key, "codec", exc)
                continue
            self._pending.setdefault(transfer.key, {})[layer_name] = blob
            self._pending_fp16[transfer.key] = self._pending_fp16.get(transfer.key, 0) + fp16
        self.metrics.encode_s += time.perf_counter() - start

    def _poison(self, key: str, kind: str, exc: BaseException) -> None:
        self.faults.record(kind, "a block's page could not be encoded: block not stored", exc)
        self._poisoned.add(key)
        self._pending.pop(key, None)
        self._pending_fp16.pop(key, None)

    def flush(self) -> list[str]:
        """Store the blocks encoded since the last flush, one entry per block; returns the keys stored."""
        stored = []
        dropped = len(self._poisoned)
        for key, layers in self._pending.items():
            if self.layers is not None and set(layers) != set(self.layers):
                missing = sorted(set(self.layers) - set(layers))
                self.faults.record("codec", f"a block entry lacks layers {missing[:3]}: block not stored")
                dropped += 1
                continue
            entry = record.pack(layers, self.codec_hash)
            if self.store.put(key, entry):  # False: over every budget or a failed disk write (the store counts it)
                stored.append(key)
                self.metrics.saved_blocks += 1
                self.metrics.stored_bytes += len(entry)
                self.metrics.fp16_bytes += self._pending_fp16[key]
            else:
                dropped += 1
        self.metrics.not_stored += dropped
        self.discard_pending()
        self._stored.extend(stored)
        return stored

    def discard_pending(self) -> None:
        """Drop what this step encoded and did not store yet (after a fault, or at flush)."""
        self._pending = {}
        self._pending_fp16 = {}
        self._poisoned = set()

    # ---------------------------------------------------------------------------------------------- load
    def load(self, layers: Mapping[str, torch.Tensor], loads: Mapping[str, Sequence[BlockTransfer]]) -> set[int]:
        """Load the planned blocks of every request into ``layers`` (layer name -> paged view).

        Returns the vLLM block ids that failed: for each request, its first block whose entry is missing, corrupt,
        unreadable, or lacks a layer, and every block after it. Blocks that loaded are scattered into every layer;
        failed blocks are left untouched for vLLM to recompute.
        """
        failed: set[int] = set()
        good: list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = []
        layout = self._layout()
        for transfers in loads.values():
            for j, transfer in enumerate(transfers):
                pages = self._read(transfer.key, layers)
                if pages is None:
                    self._failed.append(transfer.key)
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
        self.metrics.failed_loads += len(failed)
        return failed

    def fail_all(self, loads: Mapping[str, Sequence[BlockTransfer]]) -> set[int]:
        """Report every planned block failed (after an unexpected fault in :meth:`load`): vLLM recomputes them."""
        failed = {t.block_id for transfers in loads.values() for t in transfers}
        self._failed.extend(t.key for transfers in loads.values() for t in transfers)
        self.metrics.failed_loads += len(failed)
        return failed

    def _read(
        self, key: str, layers: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        # a disk fault is a miss here, counted by the store; no promotion to the CPU tier, so reading one planned
        # entry never evicts another one the scheduler offered in the same step
        entry = self.store.get(key, promote=False)
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
        except kvpages.CorruptEntry as exc:
            self.faults.record("corrupt", "a block entry failed its checks: dropped, block recomputed", exc)
            self.metrics.corrupt += 1
            self.store.delete(key)
            return None
        finally:
            self.metrics.decode_s += time.perf_counter() - start
        self.metrics.hits += 1
        return pages

    # -------------------------------------------------------------------------------------------- report
    def take_report(self) -> tuple[list[str], list[str], list[str]]:
        """``(stored, failed, evicted)`` since the last call, for the scheduler's index.

        ``stored``: entries this worker stored that are still held, plus entries other processes added to a shared
        disk directory; ``failed``: planned loads that failed; ``evicted``: entries that left the store.
        """
        added, removed = self.store.take_changes()
        gone = set(removed)
        stored = [k for k in dict.fromkeys(self._stored + added) if k not in gone and self.store.contains(k)]
        failed = list(dict.fromkeys(self._failed))
        reported = set(failed)  # a failed load's entry is reported once, as failed
        evicted = [k for k in removed if k not in reported]
        self._stored, self._failed = [], []
        return stored, failed, evicted

    def announce_existing(self) -> None:
        """Queue every key already in the store (e.g. disk entries from an earlier run) for the next report."""
        self._stored.extend(self.store.keys())

    def reset(self) -> None:
        """Drop every entry (vLLM's ``reset_cache``); the scheduler has already forgotten them."""
        self.discard_pending()
        self.store.clear()
        self.store.take_changes()
        self._stored = []

    def fault_counts(self) -> dict[str, int]:
        """Faults by kind, this worker's (codec, corrupt entries, unexpected) plus its store's (disk, budget)."""
        mine, store = self.faults.counts(), self.store.metrics.faults
        return {k: mine[k] + store.get(k, 0) for k in mine}

    def set_layout(self, layout: str) -> None:
        self.layout = layout

    def _layout(self) -> str:
        if self.layout is None:
            raise RuntimeError("the paged layout is not resolved yet (set_layout or a layout in the config)")
        return self.layout
