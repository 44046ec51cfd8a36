"""kv_vllm: compressed prefix-KV reuse for vLLM through its KV connector API.

``KVCompressConnector`` (imported on first access, since it needs vLLM) is what vLLM loads with
``"kv_connector": "KVCompressConnector", "kv_connector_module_path": "kv_vllm"``. The rest imports without vLLM:

ConnectorConfig                    the ``kv_connector_extra_config`` settings, validated (codec, budgets, disk tier)
check_codec_name                   a kvpages codec name, or a clear error (eviction methods are refused)
namespace, block_keys              cache keys: block hash chain under (model, dtype, KV shape, codec hash, ...)
gather_blocks, scatter_blocks      whole blocks out of / into vLLM's paged layer views (CPU and CUDA layouts)
SchedulerState, WorkerState        the scheduler-side and worker-side logic the connector wraps
"""

from __future__ import annotations

from typing import Any

from .config import ConnectorConfig, check_codec_name
from .keys import block_keys, namespace
from .layout import BACKEND_LAYOUTS, LAYOUTS, gather_blocks, layout_for_backend, scatter_blocks
from .scheduler import BlockTransfer, SchedulerState, StepPlan
from .worker import WorkerMetrics, WorkerState

__all__ = [
    "BACKEND_LAYOUTS",
    "LAYOUTS",
    "BlockTransfer",
    "ConnectorConfig",
    "KVCompressConnector",
    "SchedulerState",
    "StepPlan",
    "WorkerMetrics",
    "WorkerState",
    "block_keys",
    "check_codec_name",
    "gather_blocks",
    "layout_for_backend",
    "namespace",
    "scatter_blocks",
]


def __getattr__(name: str) -> Any:
    """Import the vLLM-facing connector on first access (PEP 562): ``import kv_vllm`` works without vLLM."""
    if name in ("KVCompressConnector", "KVCompressMetadata", "KVCompressWorkerMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
