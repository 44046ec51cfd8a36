"""Capacity of vLLM's pool with method tiers (``KVCOMPRESS_KV_CODEC``) against 16-bit and packed KIVI pages.

Issue 42 goal 4 for the tiers. Two parts:

1. **Bytes per token** (no engine): the pool's page bytes per token per layer, metadata and padding included, from
   kv-vllm's own page formats (:func:`kv_vllm.packed.page_format_for`, the sizes vLLM allocates by) for
   ``--block-size`` 32, bf16, at SmolLM2-135M's layer shape (3 KV heads × 64) and Llama-3-8B's (8 × 128), next to
   vLLM TurboQuant's published presets (vllm-project/vllm#38479, Qwen3-4B, head size 128: 196 / 136 / 120 / 104
   bytes per (head, token) slot against bf16's 512). TurboQuant is a comparison against published figures: the CPU
   build of vLLM does not run it.
2. **Blocks and concurrency at a fixed budget** (real vLLM, the engine tests' cached env): engine_scripts/packed.py's
   ``capacity-*`` scenarios on the tiny test Llama (2 layers, 2 KV heads × 64, float32, 32-token blocks): 16
   requests of 103 prompt + 40 generated tokens (5 blocks each), ``max_num_seqs`` 16, prefix caching off, a KV
   budget of 24 stock blocks (``kv_cache_memory_bytes``); blocks vLLM allocates, peak requests running at once,
   preemptions, engine steps.

Usage::

    OMP_NUM_THREADS=1 uv run python benchmarks/bench_vllm_tiers_capacity.py              # both parts
    OMP_NUM_THREADS=1 uv run python benchmarks/bench_vllm_tiers_capacity.py --rows ''    # bytes per token only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "integrations" / "kv-vllm" / "tests"
sys.path.insert(0, str(TESTS))

TURBOQUANT = {  # vllm-project/vllm#38479: bytes per (head, token) slot, K + V, head size 128 (bf16: 512)
    "turboquant_k8v4": 196,
    "turboquant_4bit_nc": 136,
    "turboquant_k3v4_nc": 120,
    "turboquant_3bit_nc": 104,
}
SHAPES = {"SmolLM2-135M (3 × 64)": (3, 64), "Llama-3-8B (8 × 128)": (8, 128)}


def token_bytes(setting: str, heads: int, head: int, block: int = 32) -> int:
    """Pool bytes per token per layer (all KV heads, K and V, metadata and padding) for bf16 caches."""
    import torch

    from kv_vllm.packed import PackedKVConfig, page_format_for

    if setting == "16":
        return heads * 2 * head * 2
    if setting.startswith("bits-"):
        cfg = PackedKVConfig(bits=int(setting.split("-")[1]))
    else:
        cfg = PackedKVConfig(codec=setting)
    fmt = page_format_for(cfg, block, heads, head, torch.bfloat16)
    return fmt.page_bytes // block


def bytes_table(settings: list[str]) -> dict:
    out = {}
    print("\n| setting | " + " | ".join(f"{s}: bytes/token/layer (× vs bf16)" for s in SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for s in ["16", *settings]:
        row = {}
        for label, (h, d) in SHAPES.items():
            b = token_bytes(s, h, d)
            row[label] = {"bytes": b, "ratio": h * 4 * d / b}
        out[s] = row
        print(f"| {s} | " + " | ".join(f"{r['bytes']} ({r['ratio']:.2f}×)" for r in row.values()) + " |")
    for name, slot in TURBOQUANT.items():
        cells = []
        for _label, (h, d) in SHAPES.items():
            cells.append(f"{h * slot} ({512 / slot:.2f}×)" if d == 128 else "— (published for head size 128)")
        out[name] = slot
        print(f"| {name} (published) | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="stock,16,4,2,codec-hqekv-2,codec-hex-3", help="capacity-* scenarios")
    ap.add_argument("--bytes", default="bits-4,bits-2,hqekv-2,hqekv-3.2,hex-3,hex-4", help="part 1 settings")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = {"bytes": bytes_table([s for s in args.bytes.split(",") if s])}
    rows = [r for r in args.rows.split(",") if r]
    runs = {}
    if rows:
        from vllm_env import ensure_env, run_engine_script

        python, info = ensure_env()
        with tempfile.TemporaryDirectory() as tmp:
            for r in rows:
                meta = Path(tmp) / "codec-meta" if r.startswith("codec-") else None
                runs[r] = run_engine_script(
                    python, TESTS / "engine_scripts" / "packed.py", f"capacity-{r}", tmp, method_codecs=meta
                )
                print(f"# capacity-{r}: {runs[r]['num_blocks']} blocks, {runs[r]['seconds']} s", flush=True)
        dense = runs.get("16") or runs.get("stock")
        print(
            f"\nvllm capacity (engine env: torch {info.get('torch')}), budget {dense['budget_bytes']:,} bytes\n\n"
            "| pool | page (bytes) | blocks | tokens vs 16-bit | peak running | preemptions | engine steps | finished "
            "| wall (s) |\n|---|---|---|---|---|---|---|---|---|"
        )
        for r, x in runs.items():
            print(
                f"| {r} | {x['page_bytes']:,} | {x['num_blocks']} | {x['num_blocks'] / dense['num_blocks']:.2f}× | "
                f"{x['peak_running']} | {x['preempted']} | {x['steps']} | {x['finished']}/16 | {x['seconds']} |"
            )
        result["capacity"] = {r: {k: v for k, v in x.items() if k != "tokens"} for r, x in runs.items()}
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
