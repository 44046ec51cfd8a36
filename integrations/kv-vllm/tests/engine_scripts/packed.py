"""The packed-KV backend on real vLLM (CPU): run under the engine venv (see ../vllm_env.py); prints one JSON line.

Usage: python packed.py SCENARIO WORKDIR [DTYPE]  (DTYPE: float32, the default, or bfloat16)
  stock      vLLM's own CPU_ATTN backend: the prompts' tokens and logprobs, and the blocks the pool holds
  bits-B     KVCOMPRESS_KV_BITS=B (2, 4, 8, 16) through kv_vllm.plugin.register(): the same, plus which backend ran
  codec-C    KVCOMPRESS_KV_CODEC=C (e.g. hqekv-2, hex-3; the caller puts the method packages' codecs on the path):
             the same as bits-B
  custom     register_backend(CUSTOM, PackedAttentionBackend) and --attention-backend CUSTOM, no flag: which
             backend the CPU platform runs
  capacity-B B in stock, 16, 4, 2: 16 requests (3 blocks + 7 prompt tokens, 40 generated: 5 blocks each) at a
             fixed KV budget of 24 stock blocks (kv_cache_memory_bytes): blocks allocated, peak requests running
             at once, preemptions
  capacity-codec-C  the same with KVCOMPRESS_KV_CODEC=C (codec pages; the method codecs on the path as for codec-C)
  refusals   start-up refusals, one after another in one process: bits (3-bit), group (group size 48 with head
             size 64), fp8 (--kv-cache-dtype fp8), window (a sliding-window Mistral), connector (a KV connector on
             the same engine)

Every run uses the same fixed KV memory (VLLM_CPU_KVCACHE_SPACE, set by the caller) and float32, so block counts
compare at equal memory and stock vs 16-bit compares exactly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tiny_llama import VOCAB, save_tiny_llama

BLOCK = 32
MAX_TOKENS = 40  # prompts of 3 blocks + 7 tokens: decoding completes block 3 and packs it mid-generation


def prompts() -> list[list[int]]:
    out = []
    for k in range(4):
        out.append([(7 * i + 3 + 13 * k) % (VOCAB - 10) + 10 for i in range(3 * BLOCK + 7 + 5 * k)])
    return out


DTYPE = sys.argv[3] if len(sys.argv) > 3 else "float32"


def make_llm(model: Path, **kw):
    from vllm import LLM

    args = dict(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=DTYPE,
        block_size=BLOCK,
        max_model_len=512,
        max_num_seqs=4,
        enforce_eager=os.environ.get("KVCOMPRESS_TEST_EAGER", "1") == "1",  # 0: vLLM's default compilation
        enable_prefix_caching=True,
        seed=0,
    )
    args.update(kw)
    return LLM(**args)


def generate(llm, batch: list[list[int]]) -> list[dict]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=20, ignore_eos=True)
    res = []
    for out in llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False):
        o = out.outputs[0]
        res.append(
            {
                "tokens": list(o.token_ids),
                "logprobs": [{int(t): float(lp.logprob) for t, lp in step.items()} for step in o.logprobs],
            }
        )
    return res


def packed_stats(llm) -> dict:
    """The packed backend's counters summed over its layers (empty under stock vLLM)."""
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    total: dict[str, int] = {}
    for groups in runner.attn_groups:
        for g in groups:
            for name in g.layer_names:
                impl = runner.compilation_config.static_forward_context[name].impl
                for k, v in getattr(impl, "stats", {}).items():
                    total[k] = total.get(k, 0) + v
    return total


def backend_names(llm) -> list[str]:
    """The attention backend class of every attention layer in the (in-process) engine."""
    names = set()
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    for groups in runner.attn_groups:
        for g in groups:
            names.add(g.backend.get_name())
    return sorted(names)


def run(llm) -> dict:
    core = llm.llm_engine.engine_core.engine_core
    ps = prompts()
    first = generate(llm, ps)  # batched: 4 requests, prefill at full precision, packed blocks during decode
    stats_first = packed_stats(llm)
    again = generate(llm, ps[:1])  # the same prompt: its 3 full blocks are prefix-cache hits (packed pages)
    cfg = llm.llm_engine.vllm_config.cache_config
    return {
        "backends": backend_names(llm),
        "num_blocks": cfg.num_gpu_blocks,
        "block_size": cfg.block_size,
        "kv_bytes": int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30),
        "page_bytes": page_bytes(core),
        "outputs": first,
        "again": again,
        "stats_first": stats_first,
        "stats": packed_stats(llm),
        "dtype": llm.llm_engine.vllm_config.model_config.dtype.__repr__(),
    }


def page_bytes(core) -> int:
    cfg = core.scheduler.kv_cache_config
    return sum(g.kv_cache_spec.page_size_bytes for g in cfg.kv_cache_groups)


def refuse(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the one-line start-up error (possibly wrapped by vLLM)
        text = f"{type(exc).__name__}: {exc}"
        cause = exc
        while cause is not None:
            if "kvcompress packed KV" in str(cause):
                return str(cause).splitlines()[0]
            cause = cause.__cause__ or cause.__context__
        return text.splitlines()[0]
    return "not refused"


CAPACITY_STOCK_BLOCKS = 24


def run_capacity(model: Path) -> dict:
    """Blocks, peak concurrency and preemptions at a fixed KV byte budget (the scheduler is wrapped in-process)."""
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes (CpuPlatform)
    e = 4 if DTYPE == "float32" else 2
    stock_block = 2 * 2 * BLOCK * 2 * 64 * e  # 2 layers x 2 KV heads x 32 tokens x (K + V) x 64
    budget = CAPACITY_STOCK_BLOCKS * stock_block
    llm = make_llm(model, kv_cache_memory_bytes=budget, max_num_seqs=16, enable_prefix_caching=False)
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    seen = {"peak_running": 0, "preempted": 0, "steps": 0}
    inner = sched.schedule

    def schedule(*a, **kw):
        out = inner(*a, **kw)
        seen["steps"] += 1
        seen["peak_running"] = max(seen["peak_running"], len(sched.running))
        seen["preempted"] += len(getattr(out, "preempted_req_ids", None) or ())
        return out

    sched.schedule = schedule
    batch = [[(5 * i + 11 * k + 1) % (VOCAB - 10) + 10 for i in range(3 * BLOCK + 7)] for k in range(16)]
    import time

    t0 = time.perf_counter()
    outs = generate(llm, batch)
    seen["seconds"] = round(time.perf_counter() - t0, 1)
    cfg = llm.llm_engine.vllm_config.cache_config
    return {
        "budget_bytes": budget,
        "num_blocks": cfg.num_gpu_blocks,
        "page_bytes": page_bytes(core),
        "backends": backend_names(llm),
        "finished": sum(len(o["tokens"]) == MAX_TOKENS for o in outs),
        "tokens": [o["tokens"] for o in outs],
        **seen,
    }


def save_tiny_mistral(path: Path) -> Path:
    """The tiny Llama's shapes as a Mistral with a 64-token sliding window (vLLM gives its layers a window)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        sliding_window=64,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    MistralForCausalLM(config).save_pretrained(path)
    return path


def refusal(what: str, model: Path, plugin) -> str:
    """The start-up message for one bad setting (each leaves the flag and group unset for the next)."""
    os.environ.pop("KVCOMPRESS_KV_GROUP", None)
    if what == "bits":
        os.environ["KVCOMPRESS_KV_BITS"] = "3"
        return refuse(plugin.register)
    os.environ["KVCOMPRESS_KV_BITS"] = "4"
    plugin.register()
    if what == "group":
        os.environ["KVCOMPRESS_KV_GROUP"] = "48"
        message = refuse(lambda: make_llm(model))
        os.environ.pop("KVCOMPRESS_KV_GROUP")
        return message
    if what == "fp8":
        return refuse(lambda: make_llm(model, kv_cache_dtype="fp8"))
    if what == "window":
        return refuse(lambda: make_llm(save_tiny_mistral(model.parent / "tiny-mistral-swa")))
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVCompressConnector",
        kv_connector_module_path="kv_vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
    )
    return refuse(lambda: make_llm(model, kv_transfer_config=ktc))


def main() -> None:
    scenario, workdir = sys.argv[1], Path(sys.argv[2])
    model = save_tiny_llama(workdir / "tiny-llama")
    from kv_vllm import plugin

    if scenario == "stock":
        result = run(make_llm(model))
    elif scenario.startswith("bits-"):
        os.environ["KVCOMPRESS_KV_BITS"] = scenario.split("-", 1)[1]
        plugin.register()
        result = run(make_llm(model))
    elif scenario.startswith("codec-"):
        os.environ["KVCOMPRESS_KV_CODEC"] = scenario.split("-", 1)[1]
        plugin.register()
        result = run(make_llm(model))
    elif scenario == "custom":
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CUSTOM, "kv_vllm.packed_backend.PackedAttentionBackend")
        llm = make_llm(model, attention_config={"backend": "CUSTOM"})
        result = {"backends": backend_names(llm), "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    elif scenario.startswith("capacity-codec-"):
        os.environ["KVCOMPRESS_KV_CODEC"] = scenario.split("-", 2)[2]
        plugin.register()
        result = run_capacity(model)
    elif scenario.startswith("capacity-"):
        bits = scenario.split("-", 1)[1]
        if bits != "stock":
            os.environ["KVCOMPRESS_KV_BITS"] = bits
            plugin.register()
        result = run_capacity(model)
    elif scenario == "refusals":
        result = {what: refusal(what, model, plugin) for what in ("bits", "group", "fp8", "window", "connector")}
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
