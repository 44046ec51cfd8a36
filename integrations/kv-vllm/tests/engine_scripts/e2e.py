"""End-to-end on CPU with real vLLM: run under the engine venv (see ../vllm_env.py); prints one JSON line.

Usage: python e2e.py SCENARIO WORKDIR
  reference  the prompts of every scenario below through vLLM *without* the connector: tokens and logprobs
  lossless   the same request twice: the second loads its 3-block prefix from the connector (CPU budget of about
             one block, the rest on the disk tier); then every disk entry is damaged and the request runs a third
             time: the failed blocks are recomputed
  kivi-4     the same request twice with KIVI-4 pages; reports the logprob drift of the generated tokens
  salt       one prompt under cache_salt "a", then "b", then "a" again: a hit only within one salt
  pressure   8 prompts (pairs sharing two blocks) through budgets that hold ~4 blocks, three passes in different
             orders and batchings: every request finishes, outputs as without the connector
  faults     passes while the disk tier fills up (ENOSPC), fails reads (EIO), and has its files deleted or
             corrupted under the running engine: every request finishes, outputs as without the connector
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
# the scenarios compared with a run without the connector use float32: their batches differ from the reference's
# (one request vs eight), and bf16 batching noise would blur "equal to vLLM's own output"
COMPARE_DTYPE = "float32"
CPU_BUDGET, DISK_BUDGET = 80_000, 220_000  # a float32 lossless block of the tiny model is ~66 kB


def make_llm(model: Path, extra: dict | None, dtype: str = "bfloat16"):
    """vLLM on the tiny model with the connector configured by ``extra`` (None: without the connector)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if extra is not None:
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
        dtype=dtype,
        block_size=BLOCK,
        max_model_len=512,
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=False,  # every hit on the second run comes from the connector, not vLLM's cache
        gpu_memory_utilization=0.3,
        kv_transfer_config=ktc,
        seed=0,
    )


def generate(llm, prompt: list[int], salt: str | None = None):
    (out,) = generate_many(llm, [prompt], salt)
    return out["tokens"], out["logprobs"]


def generate_many(llm, prompts: list[list[int]], salt: str | None = None) -> list[dict]:
    """Greedy generation of 8 tokens per prompt in one call; each result's tokens, top-20 logprobs, finish reason."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=20, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {})) for p in prompts]
    results = []
    for out in llm.generate(inputs, params, use_tqdm=False):
        o = out.outputs[0]
        results.append(
            {
                "tokens": list(o.token_ids),
                "logprobs": [{int(t): float(lp.logprob) for t, lp in step.items()} for step in o.logprobs],
                "finish": o.finish_reason,
            }
        )
    return results


def pressure_prompts() -> list[list[int]]:
    """8 prompts of 3 full blocks + a tail; prompts 2k and 2k + 1 share their first two blocks."""
    prompts = []
    for k in range(4):
        shared = [(11 * k + 5 * i + 3) % (VOCAB - 10) + 10 for i in range(2 * BLOCK)]
        for j in range(2):
            tail = [(13 * k + 7 * j + 3 * i + 1) % (VOCAB - 10) + 10 for i in range(BLOCK + 7)]
            prompts.append(shared + tail)
    return prompts


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
    if scenario == "reference":
        run_reference(model, prompt)
    elif scenario in ("salt", "pressure", "faults"):
        {"salt": run_salt, "pressure": run_pressure, "faults": run_faults}[scenario](model, workdir, prompt)
    else:
        run_two_passes(scenario, model, workdir, prompt)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter-exit teardown


def emit(result: dict) -> None:
    print(json.dumps(result))


def run_reference(model: Path, prompt: list[int]) -> None:
    llm = make_llm(model, None, COMPARE_DTYPE)
    emit({"prompt": generate_many(llm, [prompt])[0], "pressure": generate_many(llm, pressure_prompts())})


def disk_dir(workdir: Path, name: str) -> Path:
    path = workdir / f"disk-{name}"
    if path.exists():
        for p in path.iterdir():
            p.unlink()
    path.mkdir(exist_ok=True)
    return path


def entry_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.kvp"))


def run_salt(model: Path, workdir: Path, prompt: list[int]) -> None:
    llm = make_llm(model, {"codec": "lossless"}, COMPARE_DTYPE)
    sched, worker = connectors(llm)
    result, outs = {}, []
    for name, salt in (("a1", "tenant-a"), ("b", "tenant-b"), ("a2", "tenant-a"), ("none", None)):
        before = sched.metrics()["hit_tokens"], worker.metrics()["loaded_blocks"]
        outs.append(generate_many(llm, [prompt], salt)[0])
        after = sched.metrics()["hit_tokens"], worker.metrics()["loaded_blocks"]
        result[name] = {"hit_tokens": after[0] - before[0], "loaded_blocks": after[1] - before[1]}
    result["outputs"] = outs
    emit(result)


def run_pressure(model: Path, workdir: Path, prompt: list[int]) -> None:
    # a lossless float32 block of this model (2 layers) is ~66 kB: the CPU tier holds 1, the disk tier 3
    disk = disk_dir(workdir, "pressure")
    llm = make_llm(
        model,
        {"codec": "lossless", "cpu_bytes": CPU_BUDGET, "disk_dir": str(disk), "disk_bytes": DISK_BUDGET},
        COMPARE_DTYPE,
    )
    sched, worker = connectors(llm)
    prompts = pressure_prompts()
    order = [[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [2, 3, 0, 1, 6, 7, 4, 5]]
    passes = []
    for i, idx in enumerate(order):
        if i == 1:  # one request at a time
            outs = [generate_many(llm, [prompts[j]])[0] for j in idx]
        else:  # all at once (max_num_seqs 4: the rest wait, then run while others finish)
            outs = generate_many(llm, [prompts[j] for j in idx])
        passes.append([None] * len(prompts))
        for j, out in zip(idx, outs):
            passes[-1][j] = out
    emit(
        {
            "passes": passes,
            "scheduler": sched.metrics(),
            "worker": worker.metrics(),
            "disk_bytes_on_disk": sum(p.stat().st_size for p in entry_files(disk)),
            "budgets": [CPU_BUDGET, DISK_BUDGET],
        }
    )


def run_faults(model: Path, workdir: Path, prompt: list[int]) -> None:
    """Faults injected into the worker's store between and during passes over the pressure prompts."""
    import errno
    from unittest import mock

    disk = disk_dir(workdir, "faults")
    llm = make_llm(model, {"codec": "lossless", "cpu_bytes": CPU_BUDGET, "disk_dir": str(disk)}, COMPARE_DTYPE)
    sched, worker = connectors(llm)
    prompts = pressure_prompts()[:4]
    real_fdopen = os.fdopen

    class Full:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_fdopen(fd, mode="r", *args, **kwargs):
        if "w" in mode:
            os.close(fd)
            return Full()
        return real_fdopen(fd, mode, *args, **kwargs)

    def eio(self):
        raise OSError(errno.EIO, "Input/output error", str(self))

    steps = {}

    def run(name: str) -> None:
        before = {k: v for k, v in worker.metrics().items() if isinstance(v, (int, float))}
        outs = generate_many(llm, prompts)
        after = worker.metrics()
        steps[name] = {
            "outputs": outs,
            "delta": {k: after[k] - before.get(k, 0) for k in before if after.get(k, 0) != before.get(k, 0)},
            "entries_on_disk": len(entry_files(disk)),
        }

    with mock.patch.object(os, "fdopen", full_fdopen):
        run("disk_full")  # nothing spills to disk: entries evicted, counted
    run("fill")  # the disk recovers: entries spill to disk again
    run("hits")
    for path in entry_files(disk):
        path.unlink()
    run("deleted")  # files deleted under the running engine
    run("refill")
    for path in entry_files(disk):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    run("corrupted")
    run("refill2")
    with mock.patch.object(Path, "read_bytes", eio):
        run("read_error")
    emit({"steps": steps, "scheduler": sched.metrics(), "worker": worker.metrics()})


def run_two_passes(scenario: str, model: Path, workdir: Path, prompt: list[int]) -> None:
    if scenario == "lossless":
        # a CPU budget of about one block (a lossless block of this model, 2 layers, is ~33 kB): the rest spills
        # to the disk tier, which the corruption step then damages
        disk = disk_dir(workdir, "lossless")
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
        files = entry_files(disk)
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
    emit(result)


if __name__ == "__main__":
    main()
