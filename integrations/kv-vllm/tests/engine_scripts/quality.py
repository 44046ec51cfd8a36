"""Greedy tokens and top-k logprobs of real vLLM (CPU) on a real model: run under the engine venv (../vllm_env.py).

Usage: python quality.py SCENARIO MODEL_DIR PROMPTS_JSON  (prints one JSON line)
  stock          vLLM's own CPU_ATTN backend
  bits-B         KVCOMPRESS_KV_BITS=B (2, 4, 8, 16) through kv_vllm.plugin.register()
  bits-B-broken  the same with every packed block's key scales zeroed after packing (a deliberately broken packing,
                 to check that a quality bound catches it; never used for figures)
  codec-C        KVCOMPRESS_KV_CODEC=C (hqekv-2, hex-3, ...: a registered page codec; the caller puts the method
                 packages' codecs on the path, ``vllm_env.run_engine_script(..., method_codecs=...)``)

PROMPTS_JSON: {"prompts": [[token ids], ...], "max_tokens": int, "logprobs": int, "block_size": int,
"dtype": "float32" | "bfloat16", "max_model_len": int}. The prompts go in as token ids (``TokensPrompt``, no tokenizer
in the engine), all in one batch, greedy, ``ignore_eos``; prefix caching off so every prompt prefills itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from packed import (
    backend_names,
    packed_stats,
    page_bytes,
)  # the engine's backend names and the packed backend's counters


def break_packing() -> None:
    """Zero the key scales of every block the backend packs (keys then dequantize to their per-channel minimum)."""
    from kv_vllm import packed

    original = packed.PageFormat.pack

    def pack(self, keys, values):
        out = original(self, keys, values)
        if self.bits != 16:
            out[..., : self._sizes["ks"]] = 0
        return out

    packed.PageFormat.pack = pack


def main() -> None:
    scenario, model, spec_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    if scenario.startswith("bits-"):
        parts = scenario.split("-")
        os.environ["KVCOMPRESS_KV_BITS"] = parts[1]
        if parts[2:] == ["broken"]:
            break_packing()
        from kv_vllm import plugin

        plugin.register()
    elif scenario.startswith("codec-"):
        os.environ["KVCOMPRESS_KV_CODEC"] = scenario.split("-", 1)[1]
        from kv_vllm import plugin

        plugin.register()
    elif scenario != "stock":
        raise SystemExit(f"unknown scenario {scenario}")

    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        block_size=spec["block_size"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=len(spec["prompts"]),
        max_logprobs=spec["logprobs"],
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
    )
    t1 = time.perf_counter()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=spec["logprobs"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    t2 = time.perf_counter()
    outputs = []
    for out in outs:
        o = out.outputs[0]
        outputs.append(
            {
                "tokens": list(o.token_ids),
                "logprobs": [{str(int(t)): float(lp.logprob) for t, lp in step.items()} for step in o.logprobs],
            }
        )
    cache = llm.llm_engine.vllm_config.cache_config
    result = {
        "scenario": scenario,
        "vllm": vllm.__version__,
        "backends": backend_names(llm),
        "num_blocks": cache.num_gpu_blocks,
        "page_bytes": page_bytes(llm.llm_engine.engine_core.engine_core),
        "dtype": str(llm.llm_engine.vllm_config.model_config.dtype),
        "stats": packed_stats(llm),
        "start_seconds": round(t1 - t0, 1),
        "generate_seconds": round(t2 - t1, 1),
        "outputs": outputs,
    }
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
