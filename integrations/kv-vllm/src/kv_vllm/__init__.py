"""kv_vllm: compressed prefix-KV reuse for vLLM through its KV connector API.

``KVCompressConnector`` (imported on first access, since it needs vLLM) is what vLLM loads with
``"kv_connector": "KVCompressConnector", "kv_connector_module_path": "kv_vllm"``. The rest imports without vLLM:

ConnectorConfig                    the ``kv_connector_extra_config`` settings, validated (codec, budgets, disk tier)
check_codec_name                   a kvpages codec name, or a clear error (compression methods are refused)
namespace, request_keys            cache keys: vLLM's block hashes under (model, dtype, KV shape, codec hash, ...)
gather_blocks, scatter_blocks      whole blocks out of / into vLLM's paged layer views (CPU and CUDA layouts)
SchedulerState, WorkerState        the scheduler-side and worker-side logic the connector wraps
"""

from __future__ import annotations

from typing import Any

from .config import ConnectorConfig, check_codec_name
from .keys import namespace, request_keys
from .layout import BACKEND_LAYOUTS, LAYOUTS, gather_blocks, layout_for_backend, scatter_blocks
from .scheduler import BlockTransfer, SchedulerMetrics, SchedulerState, StepPlan
from .worker import WorkerMetrics, WorkerState

__all__ = [
    "BACKEND_LAYOUTS",
    "LAYOUTS",
    "BlockTransfer",
    "ConnectorConfig",
    "KVCompressConnector",
    "SchedulerMetrics",
    "SchedulerState",
    "StepPlan",
    "WorkerMetrics",
    "WorkerState",
    "check_codec_name",
    "gather_blocks",
    "layout_for_backend",
    "namespace",
    "request_keys",
    "scatter_blocks",
]


def __getattr__(name: str) -> Any:
    """Import the vLLM-facing connector on first access (PEP 562): ``import kv_vllm`` works without vLLM."""
    if name in ("KVCompressConnector", "KVCompressMetadata", "KVCompressWorkerMetadata", "KVCompressPromMetrics"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
