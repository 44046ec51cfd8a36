"""``KVCompressConnector``: vLLM's KV connector API (``KVConnectorBase_V1``, vLLM >= 0.32) over kvpages.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVCompressConnector", "kv_connector_module_path": "kv_vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"codec": "kivi-4", "cpu_bytes": 4294967296}}'

vLLM builds it twice: in the scheduler process (:class:`~kv_vllm.scheduler.SchedulerState`: prefix lookup, load
and save planning) and in each worker (:class:`~kv_vllm.worker.WorkerState`: gather/encode/store and
read/decode/scatter). This module is the thin glue between vLLM's types and those two; it imports vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .config import ConnectorConfig
from .keys import namespace
from .layout import layout_for_backend
from .scheduler import BlockTransfer, SchedulerState
from .worker import WorkerState

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class KVCompressMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to load (per request, in token order) and blocks to save."""

    loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)
    saves: list[BlockTransfer] = field(default_factory=list)
    reset: bool = False


@dataclass
class KVCompressWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: entries stored, planned loads that failed, entries that left the store."""

    stored: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVCompressWorkerMetadata):
            raise TypeError(f"cannot aggregate KVCompressWorkerMetadata with {type(other).__name__}")
        return KVCompressWorkerMetadata(
            self.stored + other.stored, self.failed + other.failed, self.evicted + other.evicted
        )


@dataclass
class KVCompressStats(KVConnectorStats):
    """Worker counters over an interval, logged by vLLM periodically as "KV Transfer metrics" and exported to
    Prometheus by :class:`KVCompressPromMetrics`: blocks saved / not stored / loaded / failed, hits, misses, corrupt
    entries, bytes stored and their fp16 size, codec seconds, and ``fault_<kind>`` for every fault kind;
    ``compression`` is fp16 bytes per stored byte and ``saved_bytes`` fp16 minus stored bytes over the interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}
        stored = self.data.get("stored_bytes", 0)
        out["compression"] = round(self.data.get("fp16_bytes", 0) / stored, 3) if stored else 0.0
        out["saved_bytes"] = self.data.get("fp16_bytes", 0) - stored
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


# Prometheus counters: name suffix -> (documentation, the stats keys it sums, label name or None)
_PROM_COUNTERS = {
    "blocks": ("KV blocks by event (saved, not_stored, loaded, failed_load)", "event"),
    "lookups": ("Block loads by outcome (hit, miss, corrupt)", "outcome"),
    "bytes": ("Bytes stored, and the same KV's size in fp16", "kind"),
    "faults": ("Faults turned into 'not stored' or a recompute, by kind", "kind"),
}
_PROM_SOURCES = {
    "blocks": {
        "saved_blocks": "saved",
        "not_stored": "not_stored",
        "loaded_blocks": "loaded",
        "failed_loads": "failed_load",
    },
    "lookups": {"hits": "hit", "misses": "miss", "corrupt": "corrupt"},
    "bytes": {"stored_bytes": "stored", "fp16_bytes": "fp16"},
}


class KVCompressPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of the connector, per engine: ``vllm:kvcompress_blocks_total{event}``,
    ``vllm:kvcompress_lookups_total{outcome}``, ``vllm:kvcompress_bytes_total{kind}`` and
    ``vllm:kvcompress_faults_total{kind}``, fed from :class:`KVCompressStats` intervals."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvcompress_{name}_total", documentation=doc, labelnames=[*self._labelnames, label]
            )
            for name, (doc, label) in _PROM_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = list(self.per_engine_labelvalues[engine_idx])
        for name, sources in _PROM_SOURCES.items():
            for key, label in sources.items():
                value = transfer_stats_data.get(key, 0)
                if value:
                    self._counters[name].labels(*engine, label).inc(value)
        for key, value in transfer_stats_data.items():
            if key.startswith("fault_") and value:
                self._counters["faults"].labels(*engine, key.removeprefix("fault_")).inc(value)


def _kv_spec(kv_cache_config: KVCacheConfig | None) -> Any:
    """The single full-attention KV spec this connector supports, or a clear error."""
    if kv_cache_config is None:
        raise ValueError("KVCompressConnector needs vLLM's kv_cache_config (vLLM >= 0.32 passes it)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"KVCompressConnector supports models with one KV cache group (full attention in every layer); this "
            f"model has {len(groups)} groups (sliding-window or hybrid layers)"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec":
        raise NotImplementedError(f"KVCompressConnector supports full attention only, got {type(spec).__name__}")
    if spec.dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"KVCompressConnector encodes float16/bfloat16/float32 KV; the KV cache dtype is {spec.dtype} "
            f"(use --kv-cache-dtype auto)"
        )
    return spec


class KVCompressConnector(KVConnectorBase_V1):
    """Compressed prefix-KV reuse for vLLM: whole blocks of prompt KV stored through a kvpages codec.

    * Scheduler side: block-aligned prefix lookup (no side effects) over the index of stored entries, keyed by
      vLLM's own block hashes (tokens, LoRA, multimodal inputs, ``cache_salt``, prompt embeddings) under the model,
      KV dtype and shape and the codec's config hash; the workers report what they stored and what left the store
      (evictions, corrupt or vanished entries), so a lookup offers only what the store last held; synchronous loads.
    * Worker side: ``save_kv_layer`` gathers the step's newly completed prompt blocks from the paged layer and
      encodes them; ``wait_for_save`` stores one entry per block in a :class:`kvpages.TieredStore` (CPU LRU byte
      budget, optional disk tier); ``start_load_kv`` decodes and scatters planned blocks into the allocated ones.
      Failed loads (missing, truncated, corrupt, unreadable) are reported through
      ``get_block_ids_with_load_errors``, so vLLM recomputes them: ``kv_load_failure_policy: "recompute"`` is
      required (refused otherwise). No fault of the codec or the store escapes into the engine step: each is
      "not stored" or "recompute", counted in the metrics by kind and logged once per kind.

    It saves storage and prefill compute on prefix hits, not GPU memory during decode, and never evicts tokens.
    Tensor and pipeline parallelism are not supported yet (a clear error at start-up).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise NotImplementedError(
                "KVCompressConnector supports tensor_parallel_size = pipeline_parallel_size = 1 for now, got "
                f"{parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}"
            )
        spec = _kv_spec(kv_cache_config)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self.codec = self.config.build_codec()
        model = vllm_config.model_config
        ns = namespace(
            model=f"{model.model}@{model.revision or ''}",
            dtype=_DTYPE_NAMES[spec.dtype],
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            block_size=spec.block_size,
            codec_hash=self.codec.config_hash(),
            tag=self.config.tag,
        )
        policy = self._kv_transfer_config.kv_load_failure_policy
        if policy != "recompute":
            raise ValueError(
                f"KVCompressConnector needs kv_load_failure_policy 'recompute', got {policy!r}: its entries live in a "
                f"best-effort cache (an entry can be evicted, deleted or damaged between a lookup and its load), and "
                f"under {policy!r} such a block fails the request instead of being recomputed"
            )
        self.scheduler: SchedulerState | None = None
        self.worker: WorkerState | None = None
        self._load_errors: set[int] = set()
        self._save_failed = False
        self._announced = False
        self._stats_base: dict[str, float] = {}
        hash_block = kv_cache_config.hash_block_size or spec.block_size  # None before vLLM resolves it
        if spec.block_size % hash_block:
            raise NotImplementedError(
                f"KVCompressConnector: vLLM hashes blocks of {hash_block} tokens, not a divisor of the KV block size "
                f"{spec.block_size}"
            )
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerState(ns, spec.block_size, spec.block_size // hash_block)
        else:
            layout = None if self.config.layout == "auto" else self.config.layout
            self.worker = WorkerState(self.codec, self.config.build_store(), layout, self._layer_names)
        logger.info("KVCompressConnector (%s): codec %r, namespace %s", role.name, self.config.codec, ns)

    # =========================================================================================== scheduler
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        hits = self.scheduler.lookup(request.block_hashes, request.num_prompt_tokens, num_computed_tokens)
        return hits, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        block_ids = blocks.get_block_ids()[0]
        self.scheduler.after_alloc(
            request.request_id, request.block_hashes, request.num_prompt_tokens, block_ids, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        num_scheduled = scheduler_output.num_scheduled_tokens
        new = [
            (r.req_id, r.block_ids[0], r.num_computed_tokens, num_scheduled.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached_reqs = scheduler_output.scheduled_cached_reqs
        cached = []
        for i, req_id in enumerate(cached_reqs.req_ids):
            new_ids = cached_reqs.new_block_ids[i]
            cached.append(
                (
                    req_id,
                    None if new_ids is None else new_ids[0],
                    req_id in cached_reqs.resumed_req_ids,
                    cached_reqs.num_computed_tokens[i],
                    num_scheduled.get(req_id, 0),
                )
            )
        plan = self.scheduler.build(new, cached)
        return KVCompressMetadata(loads=plan.loads, saves=plan.saves, reset=plan.reset)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVCompressWorkerMetadata):
            self.scheduler.on_worker_report(meta.stored, meta.failed, meta.evicted)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: forget every entry now; the workers drop their
        stores (CPU and disk) at the start of the next step, before any load or save."""
        if self.scheduler is None:
            return None
        self.scheduler.reset()
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None  # saves are synchronous: the blocks may be freed now

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ============================================================================================== worker
    def _resolve_layout(self, layer_name: str) -> None:
        assert self.worker is not None
        if self.worker.layout is not None:
            return
        layer = self._vllm_config.compilation_config.static_forward_context.get(layer_name)
        backend = getattr(layer, "attn_backend", None)
        if backend is None:
            raise ValueError(f"cannot find the attention backend of layer {layer_name!r}; set layout explicitly")
        self.worker.set_layout(layout_for_backend(backend.get_name()))

    def _kv_layers(self, forward_context: ForwardContext) -> dict[str, torch.Tensor]:
        layers = {}
        for name in self._layer_names:
            layer = forward_context.no_compile_layers.get(name)
            kv = getattr(layer, "kv_cache", None)  # vLLM's attention layers hold their paged view here
            if isinstance(kv, torch.Tensor):
                layers[name] = kv
        return layers

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCompressMetadata)
        if meta.reset:
            try:
                self.worker.reset()
            except Exception as exc:  # never in the engine step; what could not be removed is a later miss
                self.worker.faults.record("unexpected", "reset_cache did not complete", exc)
        if not meta.loads:
            return
        try:
            layers = self._kv_layers(forward_context)
            self._resolve_layout(next(iter(layers)))
            self._load_errors |= self.worker.load(layers, meta.loads)
        except Exception as exc:  # an unexpected fault: every planned block is recomputed, none is trusted
            self.worker.faults.record("unexpected", "loads failed: every planned block recomputed", exc)
            self._load_errors |= self.worker.fail_all(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCompressMetadata)
        if not meta.saves or layer_name not in self._layer_names:
            return
        try:
            self._resolve_layout(layer_name)
            self.worker.save_layer(layer_name, kv_layer, meta.saves)
        except Exception as exc:  # an unexpected fault: this step stores nothing (the entries would lack a layer)
            self.worker.faults.record("unexpected", "saves failed: this step's blocks not stored", exc)
            self.worker.metrics.not_stored += len(meta.saves)
            self.worker.discard_pending()
            self._save_failed = True

    def wait_for_save(self) -> None:
        assert self.worker is not None
        try:
            if self._save_failed:
                self.worker.discard_pending()
            else:
                self.worker.flush()
        except Exception as exc:
            self.worker.faults.record("unexpected", "saves failed: this step's blocks not stored", exc)
            self.worker.discard_pending()
        finally:
            self._save_failed = False

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        try:
            if not self._announced:  # entries on disk from an earlier run become hits
                self.worker.announce_existing()
                self._announced = True
            stored, failed, evicted = self.worker.take_report()
        except Exception as exc:  # the index stays as it was; a stale entry is a failed load, recomputed
            self.worker.faults.record("unexpected", "worker report skipped this step", exc)
            return None
        if not stored and not failed and not evicted:
            return None
        return KVCompressWorkerMetadata(stored, failed, evicted)

    # ============================================================================================= metrics
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's counters since the last call (vLLM aggregates and logs them)."""
        if self.worker is None:
            return None
        now = {k: v for k, v in self.worker.metrics.__dict__.items() if isinstance(v, (int, float))}
        now.update(self.worker.fault_counts())
        delta = {k: v - self._stats_base.get(k, 0) for k, v in now.items()}
        self._stats_base = now
        stats = KVCompressStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVCompressStats(data=dict(data)) if data is not None else KVCompressStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """Register the connector's Prometheus counters (:class:`KVCompressPromMetrics`)."""
        return KVCompressPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def metrics(self) -> dict[str, Any]:
        """Counters of this side: scheduler (lookups, hit tokens) or worker (blocks, bytes, codec seconds, store)."""
        if self.scheduler is not None:
            return {
                "role": "scheduler",
                "indexed_blocks": len(self.scheduler.index),
                **self.scheduler.metrics.as_dict(),
            }
        assert self.worker is not None
        return {
            "role": "worker",
            **self.worker.metrics.as_dict(),
            **self.worker.fault_counts(),
            "store": self.worker.store.metrics.as_dict(),
        }

    def shutdown(self) -> None:
        logger.info("KVCompressConnector metrics: %s", self.metrics())
