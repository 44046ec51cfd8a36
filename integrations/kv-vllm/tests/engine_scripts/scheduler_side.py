"""Connector creation through vLLM's factory and scheduler-side behaviour through vLLM's real ``Scheduler``.

Run under the engine venv (see ../vllm_env.py): ``python scheduler_side.py WORKDIR``; prints one JSON line of
checks (name -> value) that the workspace test asserts on. Follows the pattern of vLLM's own
tests/v1/kv_connector/unit/utils.py (a real Scheduler on CPU, requests built by hand, model-runner outputs faked),
with ModelConfig pointed at a tiny local model instead of the hub.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from tiny_llama import save_tiny_llama

BLOCK = 32


def vllm_config(model: Path, extra: dict, name: str = "KVCompressConnector", module: str | None = "kv_vllm"):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model), dtype="float16", seed=0, skip_tokenizer_init=True)
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=512,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=False
    )
    ktc = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int = 64):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def make_request(rid: str, prompt: list[int], hashed: bool = True, **kwargs):
    """A real vLLM Request with vLLM's own block hasher (``kwargs``: cache_salt, lora_request, ...)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256) if hashed else None,
        **kwargs,
    )


def runner_output(reqs, token: int, worker_meta=None, invalid=None):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    kv_out = None
    if worker_meta is not None or invalid:
        kv_out = KVConnectorOutput(invalid_block_ids=set(invalid or ()), kv_connector_worker_meta=worker_meta)
    ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_out,
    )


def main() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    import kv_vllm
    from kv_vllm.connector import KVCompressConnector, KVCompressMetadata, KVCompressWorkerMetadata
    from kv_vllm.plugin import register

    workdir = Path(sys.argv[1])
    model = save_tiny_llama(workdir / "tiny-llama")
    checks: dict = {}

    # 1. the factory builds our class from the documented config, for both roles
    cfg = vllm_config(model, {"codec": "kivi-4", "cpu_bytes": 1 << 24})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(cfg, role, kv_cache_config())
        checks[f"factory_{role.name.lower()}"] = type(conn).__name__
    checks["factory_codec"] = conn.codec.name
    register()
    register()  # idempotent, as vLLM may call plugins more than once
    short = KVConnectorFactory.create_connector(
        vllm_config(model, {}, module=None), KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    checks["plugin_short_name"] = type(short).__name__
    try:
        KVConnectorFactory.create_connector(
            vllm_config(model, {"codec": "snapkv"}), KVConnectorRole.SCHEDULER, kv_cache_config()
        )
        checks["eviction_refused"] = ""
    except ValueError as exc:
        checks["eviction_refused"] = str(exc)

    # 2. a real Scheduler: first request saves its full prompt blocks, second one loads them
    cfg = vllm_config(model, {"codec": "lossless"})
    cfg.cache_config.num_gpu_blocks = 64
    sched = Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        log_stats=True,
    )
    conn = sched.connector
    checks["scheduler_connector"] = type(conn).__name__
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    r1 = make_request("r1", prompt)
    sched.add_request(r1)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVCompressMetadata)
    checks["r1_scheduled_tokens"] = out.num_scheduled_tokens["r1"]
    checks["r1_saves"] = len(meta.saves)
    checks["r1_loads"] = len(meta.loads)
    checks["r1_save_blocks_are_its_blocks"] = [t.block_id for t in meta.saves] == out.scheduled_new_reqs[0].block_ids[
        0
    ][:3]
    # the worker reports the entries it stored; the request then finishes
    report = KVCompressWorkerMetadata(stored=[t.key for t in meta.saves])
    sched.update_from_output(out, runner_output([r1], 2, worker_meta=report))
    for _ in range(6):
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            break
        sched.update_from_output(out, runner_output([r1], 2))
    checks["r1_tracked_after_finish"] = conn.scheduler.tracked_requests
    checks["indexed_blocks"] = len(conn.scheduler.index)

    # lookups have no side effects
    r2 = make_request("r2", prompt)
    checks["lookup_repeated"] = [conn.get_num_new_matched_tokens(r2, 0) for _ in range(3)]
    sched.add_request(r2)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    checks["r2_scheduled_tokens"] = out.num_scheduled_tokens["r2"]
    checks["r2_loads"] = len(meta.loads.get("r2", []))
    checks["r2_load_blocks_are_its_blocks"] = [t.block_id for t in meta.loads["r2"]] == out.scheduled_new_reqs[
        0
    ].block_ids[0][:3]
    checks["r2_saves"] = len(meta.saves)
    # 3. the worker reports the second block failed to load and missing: vLLM recomputes from it
    failed = {meta.loads["r2"][1].block_id, meta.loads["r2"][2].block_id}
    report = KVCompressWorkerMetadata(failed=[meta.loads["r2"][1].key, meta.loads["r2"][2].key])
    sched.update_from_output(out, runner_output([r2], 2, worker_meta=report, invalid=failed))
    checks["r2_computed_after_failure"] = r2.num_computed_tokens
    out = sched.schedule()
    checks["r2_rescheduled_tokens"] = out.num_scheduled_tokens.get("r2", 0)
    meta = out.kv_connector_metadata
    checks["r2_resaves_after_failure"] = len(meta.saves)
    checks["lookup_after_missing"] = conn.get_num_new_matched_tokens(make_request("r3", prompt), 0)[0]

    # 4. isolation on real block hashes: same token ids, other cache_salt / LoRA adapter -> other keys
    from vllm.lora.request import LoRARequest

    variants = {
        "plain": {},
        "salt_a": {"cache_salt": "tenant-a"},
        "salt_b": {"cache_salt": "tenant-b"},
        "lora_1": {"lora_request": LoRARequest("adapter-1", 1, "/nonexistent/adapter-1")},
        "lora_2": {"lora_request": LoRARequest("adapter-2", 2, "/nonexistent/adapter-2")},
    }
    state = conn.scheduler
    keys = {}
    for name, kwargs in variants.items():
        req = make_request(f"iso-{name}", prompt, **kwargs)
        keys[name] = state.prompt_keys(req.block_hashes, req.num_prompt_tokens)
    checks["isolation_distinct_key_sets"] = len({k[0] for k in keys.values()})
    state.on_worker_report(keys["salt_a"] + keys["lora_1"], [])
    checks["isolation_lookups"] = {
        name: conn.get_num_new_matched_tokens(make_request(f"iso2-{name}", prompt, **kw), 0)[0]
        for name, kw in variants.items()
    }
    # 5. a request vLLM gave no block hashes: no hit, nothing saved, counted
    bare = make_request("bare", prompt, hashed=False)
    checks["unhashed_lookup"] = conn.get_num_new_matched_tokens(bare, 0)[0]
    # 6. an eviction the worker reports removes the hit before any load is planned
    state.on_worker_report([], [], keys["salt_a"][:1])
    checks["lookup_after_eviction"] = conn.get_num_new_matched_tokens(
        make_request("ev", prompt, cache_salt="tenant-a"), 0
    )[0]
    # 7. vLLM's reset_prefix_cache(reset_connector=True) empties the index and tells the workers once
    checks["reset_ok"] = sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    checks["indexed_after_reset"] = len(state.index)
    out = sched.schedule()
    checks["reset_in_metadata"] = [out.kv_connector_metadata.reset, sched.schedule().kv_connector_metadata.reset]
    # 8. the load-failure policy that would fail requests is refused at creation
    fail_cfg = vllm_config(model, {})
    fail_cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    try:
        KVConnectorFactory.create_connector(fail_cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
        checks["fail_policy_refused"] = ""
    except ValueError as exc:
        checks["fail_policy_refused"] = str(exc)
    # 9. Prometheus: vLLM's metric classes, our counters
    import prometheus_client

    prom = KVCompressConnector.build_prom_metrics(
        cfg,
        {
            prometheus_client.Gauge: prometheus_client.Gauge,
            prometheus_client.Counter: prometheus_client.Counter,
            prometheus_client.Histogram: prometheus_client.Histogram,
        },
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe({"saved_blocks": 3, "failed_loads": 2, "hits": 4, "stored_bytes": 100, "fault_disk_full": 5})
    sample = prometheus_client.REGISTRY.get_sample_value
    labels = {"model_name": "tiny", "engine": "0"}
    checks["prom"] = [
        sample("vllm:kvcompress_blocks_total", {**labels, "event": "saved"}),
        sample("vllm:kvcompress_blocks_total", {**labels, "event": "failed_load"}),
        sample("vllm:kvcompress_lookups_total", {**labels, "outcome": "hit"}),
        sample("vllm:kvcompress_bytes_total", {**labels, "kind": "stored"}),
        sample("vllm:kvcompress_faults_total", {**labels, "kind": "disk_full"}),
    ]
    checks["scheduler_metrics"] = conn.metrics()
    checks["kv_vllm_version_import"] = (
        hasattr(kv_vllm, "KVCompressConnector") and KVCompressConnector is kv_vllm.KVCompressConnector
    )
    print(json.dumps(checks))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
