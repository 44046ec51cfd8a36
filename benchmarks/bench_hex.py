"""HEX (kv-hex): bytes held vs the theoretical size, and expander mask generation time, for real models' shapes.

One run prints two tables:

* **bytes** -- one layer of fp16 K/V (random values; bytes do not depend on them) written through ``kv_hex.hex(b)``'s
  plan into a ``HEXStore``, for SmolLM2-135M (3 KV heads × 64) and LLaMA-3-8B (8 × 128) shapes: ``nbytes()`` as
  a fraction of the fp16 cache, the same without int32 positions / counts ("payload"), and the theoretical fraction
  from HEX's layout (no metadata): full-precision tokens at 16 bits; coded tokens at ``b`` bits + the overlay's
  ``16·ρ`` + the value statistics' ``32 / (H·d_h)`` per element; key statistics ``32 / n`` per element. The paper
  reports 25.35 % (HEX-3) and 31.50 % (HEX-4) without a formula (Table 1).
* **decode_bytes** -- the same stores after a decode: a ``--decode-prompt``-token prefill written through the plan,
  then ``--decode-tokens`` tokens appended one at a time (append mode: each full block of 96 decoded tokens is
  compressed as a segment, the rest stays at 16 bits until its block fills). ``nbytes()`` as a fraction of the fp16
  cache of every token held, and the decoded tokens' own cost (bytes added since the prefill / their fp16 bytes).
  The paper's 31.50 % (HEX-4) is a prefill figure; this table says what a long generation costs.
* **masks** -- cold generation time of the Ramanujan-checked expander masks (draw + SVD check), tries and σ₂ against
  the bound, for one block (96) and longer prefill segments.

* **attend** -- one decode step (one query token, GQA) over one HEX-3 layer in append mode (a prefill of ``L``
  tokens, then 96 + 40 decoded tokens: the prefill segment, one decode block and a 40 + ``L mod 96``-token
  residual), median of ``--reps`` calls after a warm-up: ``HEXStore.attend`` (part by part, merged by
  log-sum-exp; the Triton kernel on CUDA, each part read in place on CPU) vs dequantize-then-SDPA
  (``read()`` then ``torch.nn.functional.scaled_dot_product_attention``) vs fp16 SDPA over the uncompressed cache.
  On CPU this times the PyTorch path (``kv_hex.segment_attention``); the Triton kernel's speed needs a GPU.

* **blocks** -- ``attend`` over one HEX-3 layer at SmolLM2's shape as a decode grows (a 2,048-token prefill, then
  192 ... 1,920 decoded tokens: one more compressed segment per 96), to show what each decode block costs.

Usage::

    python benchmarks/bench_hex.py                  # every table
    python benchmarks/bench_hex.py --tables attend  # one table
    python benchmarks/bench_hex.py --tables blocks --reps 21
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import kv_hex
from kv_hex import HEXConfig, HEXStore
from kv_hex.expander import expander_mask
from kvcore import Plan, Scores

SHAPES = {"SmolLM2-135M": (3, 64), "LLaMA-3-8B": (8, 128)}


def theoretical(cfg: HEXConfig, n: int, H: int, D: int) -> float:
    full = min(n, cfg.heavy_count(n) + cfg.recent) / n
    coded = (cfg.bits + 16 * cfg.rho + 32 / (H * D)) / 16
    return full + (1 - full) * coded + 2 / n


def bytes_table(lengths: list[int]) -> None:
    print("| model | bits | tokens | nbytes | % of fp16 | payload % | theoretical % |")
    print("|---|---|---|---|---|---|---|")
    for model, (H, D) in SHAPES.items():
        for bits in (3, 4):
            for n in lengths:
                comp = kv_hex.hex(bits)
                cfg = comp.new_store().config
                x = torch.randn(1, H, n, D, dtype=torch.float16)
                plan = comp.selector.select(Scores(torch.zeros(1, H, n)), comp.budget)
                assert isinstance(plan, Plan)
                store = HEXStore(cfg)
                store.write(x, x, plan, torch.arange(n)[None])
                r = store.memory_report()
                print(
                    f"| {model} | {bits} | {n} | {r['nbytes']} | {100 * r['fraction_of_fp16']:.2f} | "
                    f"{100 * r['payload_fraction_of_fp16']:.2f} | {100 * theoretical(cfg, n, H, D):.2f} |"
                )


def decode_bytes_table(prompt: int, decoded: list[int]) -> None:
    """Bytes held after a ``prompt``-token prefill and each count of ``decoded`` tokens appended one at a time."""
    print("| model | bits | prefill | decoded | nbytes | % of fp16 (all held) | decoded tokens' % of their fp16 |")
    print("|---|---|---|---|---|---|---|")
    for model, (H, D) in SHAPES.items():
        for bits in (3, 4):
            comp = kv_hex.hex(bits)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(1, H, prompt, D, generator=g).to(torch.float16)
            plan = comp.selector.select(Scores(torch.rand(1, 1, prompt, generator=g).expand(1, H, prompt)), comp.budget)
            store = HEXStore(comp.new_store().config)
            store.write(x, x, plan, torch.arange(prompt)[None])
            base, done = store.nbytes(), 0
            for target in decoded:
                while done < target:
                    t = torch.randn(1, H, 1, D, generator=g).to(torch.float16)
                    store.append(t, t, torch.tensor([[prompt + done]]))
                    done += 1
                fp16 = 2 * H * D * 2  # K and V, 2 bytes each, per token
                own = f"{100 * (store.nbytes() - base) / (fp16 * done):.2f}" if done else "–"
                print(
                    f"| {model} | {bits} | {prompt} | {done} | {store.nbytes()} | "
                    f"{100 * store.nbytes() / (fp16 * (prompt + done)):.2f} | {own} |"
                )


def mask_table(lengths: list[int]) -> None:
    print("| d (channels) | n (tokens) | d1 | d2 | σ2 | bound | tries | seconds | table bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for _model, (H, D) in SHAPES.items():
        for n in lengths:
            expander_mask.cache_clear()
            t0 = time.perf_counter()
            t = expander_mask(n, H * D, 0.03125)
            dt = time.perf_counter() - t0
            spec = f"{t.d1} | {t.d2} | {t.sigma2:.3f} | {t.bound:.3f} | {t.tries}"
            print(f"| {H * D} | {n} | {spec} | {dt:.3f} | {t.nbytes} |")


def _median_ms(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def attend_table(lengths: list[int], reps: int, device: str) -> None:
    QH = {"SmolLM2-135M": 9, "LLaMA-3-8B": 32}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print("| model | context | fused attend ms | dequantize + SDPA ms | fp16 SDPA ms | attend / fp16 SDPA |")
    print("|---|---|---|---|---|---|")
    for model, (H, D) in SHAPES.items():
        Hq = QH[model]
        for n in lengths:
            comp = kv_hex.hex(3)
            cfg = comp.new_store().config
            k = torch.randn(1, H, n, D, dtype=torch.float16, device=device)
            v = torch.randn(1, H, n, D, dtype=torch.float16, device=device)
            plan = comp.selector.select(Scores(torch.rand(1, H, n)), comp.budget)
            store = HEXStore(cfg)
            store.write(k, v, Plan(plan.key_bits.to(device)), torch.arange(n, device=device)[None])
            extra = 96 + 40
            nk = torch.randn(1, H, extra, D, dtype=torch.float16, device=device)
            for i in range(extra):  # decode: one token a step (a full block is compressed on the way)
                store.append(nk[:, :, i : i + 1], nk[:, :, i : i + 1], torch.tensor([[n + i]], device=device))
            K, V = torch.cat([k, nk], 2), torch.cat([v, nk], 2)
            q = torch.randn(1, Hq, 1, D, dtype=torch.float16, device=device)

            def deq_sdpa(store=store, q=q, G=Hq // H):
                view = store.read()
                bias = view.logit_bias.repeat_interleave(G, 1)[:, :, None, :].to(view.keys.dtype)
                return F.scaled_dot_product_attention(q, view.keys, view.values, attn_mask=bias, enable_gqa=True)

            fused = _median_ms(lambda store=store, q=q: store.attend(q), reps, sync)
            deq = _median_ms(deq_sdpa, reps, sync)
            fp16 = _median_ms(
                lambda q=q, K=K, V=V: F.scaled_dot_product_attention(q, K, V, enable_gqa=True), reps, sync
            )
            print(f"| {model} | {n + extra} | {fused:.2f} | {deq:.2f} | {fp16:.3f} | {fused / fp16:.0f}x |")


def blocks_table(prompt: int, decoded: list[int], reps: int, device: str) -> None:
    """``attend`` time as a decode grows: one HEX-3 layer at SmolLM2's shape after a ``prompt``-token prefill, then
    after each count of ``decoded`` tokens (append mode: one compressed segment per 96 decoded tokens)."""
    H, D, Hq = 3, 64, 9
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    comp = kv_hex.hex(3)
    cfg = comp.new_store().config
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, H, prompt, D, generator=g).to(device)
    v = torch.randn(1, H, prompt, D, generator=g).to(device)
    # heavy hitters global across heads, as HEX's scorer makes them
    plan = comp.selector.select(Scores(torch.rand(1, 1, prompt, generator=g).expand(1, H, prompt)), comp.budget)
    store = HEXStore(cfg)
    store.write(k, v, Plan(plan.key_bits.to(device)), torch.arange(prompt, device=device)[None])
    q = torch.randn(1, Hq, 1, D, generator=g).to(device)
    print("| decoded tokens | segments | attend ms | attend / attend at 0 |")
    print("|---|---|---|---|")
    done, first = 0, None
    for target in decoded:
        while done < target:
            x = torch.randn(1, H, 1, D, generator=g).to(device)
            store.append(x, x, torch.tensor([[prompt + done]], device=device))
            done += 1
        ms = _median_ms(lambda: store.attend(q), reps, sync)
        first = ms if first is None else first
        print(f"| {done} | {len(store._segments)} | {ms:.2f} | {ms / first:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="96,960,1920")
    p.add_argument("--attend-lengths", default="960,3840")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--tables", default="bytes,decode_bytes,masks,attend", help="any of bytes, decode_bytes, masks, attend, blocks"
    )
    p.add_argument("--decode-prompt", type=int, default=960)
    p.add_argument("--decode-tokens", default="0,96,480,960,1920")
    p.add_argument("--blocks-prompt", type=int, default=2048)
    p.add_argument("--blocks-decoded", default="0,192,480,960,1920")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    tables = set(a.tables.split(","))
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} torch={torch.__version__}")
    if device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}")
    print(f"load average: {os.getloadavg()}, torch threads: {torch.get_num_threads()}")
    if "bytes" in tables:
        bytes_table(lengths)
        print()
    if "decode_bytes" in tables:
        decode_bytes_table(a.decode_prompt, [int(x) for x in a.decode_tokens.split(",")])
        print()
    if "masks" in tables:
        mask_table(lengths)
        print()
    if "attend" in tables:
        attend_table([int(x) for x in a.attend_lengths.split(",")], a.reps, device)
        print()
    if "blocks" in tables:
        blocks_table(a.blocks_prompt, [int(x) for x in a.blocks_decoded.split(",")], a.reps, device)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
