"""vLLM general plugin: registers ``KVCompressConnector`` under its short name in every vLLM process.

With kv-vllm installed in vLLM's environment, ``"kv_connector": "KVCompressConnector"`` then works without
``kv_connector_module_path``. vLLM may call this more than once per process; it registers once.
"""

from __future__ import annotations

import contextlib

NAME = "KVCompressConnector"


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # "already registered": an earlier call in this process
        KVConnectorFactory.register_connector(NAME, "kv_vllm.connector", NAME)
