"""End-to-end on CPU with real vLLM: run under the engine venv (see ../vllm_env.py); prints one JSON line.

Usage: python e2e.py SCENARIO WORKDIR
  lossless  the same request twice: the second loads its 3-block prefix from the connector (CPU budget of about
            one block, the rest on the disk tier); then every disk entry is damaged and the request runs a third
            time: the failed blocks are recomputed
  kivi-4    the same request twice with KIVI-4 pages; reports the logprob drift of the generated tokens
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tiny_llama import VOCAB, save_tiny_llama

BLOCK = 32
PROMPT_TOKENS = 3 * BLOCK + 7  # 3 full blocks offered to the connector, 7 tokens computed by vLLM


def make_llm(model: Path, extra: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVCompressConnector",
        kv_connector_module_path="kv_vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=512,
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=False,  # every hit on the second run comes from the connector, not vLLM's cache
        gpu_memory_utilization=0.3,
        kv_transfer_config=ktc,
        seed=0,
    )


def generate(llm, prompt: list[int]):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=20, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [{int(t): float(lp.logprob) for t, lp in step.items()} for step in out.logprobs]


def connectors(llm):
    """(scheduler-side, worker-side) connector objects of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector, get_kv_transfer_group()


def drift(a: list[dict], b: list[dict]) -> float:
    """Max |logprob difference| over tokens in both top-20 lists, over the generated steps."""
    worst = 0.0
    for sa, sb in zip(a, b):
        for t in set(sa) & set(sb):
            worst = max(worst, abs(sa[t] - sb[t]))
    return worst


def snapshot(sched, worker) -> dict:
    return {"worker": worker.metrics(), "scheduler": sched.metrics()}


def main() -> None:
    scenario, workdir = sys.argv[1], Path(sys.argv[2])
    model = save_tiny_llama(workdir / "tiny-llama")
    prompt = [(7 * i + 3) % (VOCAB - 10) + 10 for i in range(PROMPT_TOKENS)]
    if scenario == "lossless":
        # a CPU budget of about one block (a lossless block of this model, 2 layers, is ~33 kB): the rest spills
        # to the disk tier, which the corruption step then damages
        disk = workdir / "disk-lossless"
        disk.mkdir(exist_ok=True)
        extra = {"codec": "lossless", "cpu_bytes": 40_000, "disk_dir": str(disk)}
    elif scenario == "kivi-4":
        extra = {"codec": "kivi-4"}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    start = time.perf_counter()
    llm = make_llm(model, extra)
    sched, worker = connectors(llm)
    taken = []
    original = worker.get_kv_connector_stats

    def recording():
        stats = original()
        if stats is not None:
            taken.append(stats)
        return stats

    worker.get_kv_connector_stats = recording
    result: dict = {"scenario": scenario, "startup_s": round(time.perf_counter() - start, 1)}

    tokens1, lp1 = generate(llm, prompt)  # computes everything, saves 3 blocks
    result["first"] = snapshot(sched, worker)
    tokens2, lp2 = generate(llm, prompt)  # loads 3 blocks
    result["second"] = snapshot(sched, worker)
    # vLLM's model runner takes the worker's stats every step (for its periodic "KV Transfer metrics" log):
    # the intervals it took, aggregated the way vLLM does, must add up to the worker's totals
    total = type(worker).build_kv_connector_stats({})
    for interval in taken:
        total = total.aggregate(type(worker).build_kv_connector_stats(interval.data))
    result["stats_intervals"] = len(taken)
    result["stats_total"] = total.reduce()
    result["tokens"] = [tokens1, tokens2]
    result["identical"] = tokens1 == tokens2
    result["drift"] = drift(lp1, lp2)
    result["first_step_drift"] = drift(lp1[:1], lp2[:1])
    result["cpu_budget"] = worker.worker.store.cpu_budget
    if scenario == "lossless":
        files = sorted(p for p in disk.iterdir() if p.is_file())
        result["disk_files"] = len(files)
        for path in files:  # damage every disk entry: those blocks fail their checksum on load
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        tokens3, lp3 = generate(llm, prompt)
        result["third"] = snapshot(sched, worker)
        result["identical_after_corruption"] = tokens3 == tokens1
        result["drift_after_corruption"] = drift(lp1, lp3)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter-exit teardown


if __name__ == "__main__":
    main()
