"""Registers, spills and shared memory of the decode-attention kernels at a serving shape, compiled for sm_90
without a GPU (see :mod:`sm90_compile_plugin`): kvcodec's KIVI attention, KIVI's decode-layout attention,
HqeKV's mixed-tier attention, HEX's part and uniform attention and SEKV's biased attention (with and without a
bias), routing gate and Stage-2 factored attention, Llama-3-8B's
attention shape (32 query heads, 8 KV heads, head dim 128), float16, one query per head, 16,384 cached tokens
(HqeKV's kernel twice: over per-entry maps and over the block layout of the decode path; its re-plan's window
importance kernels over dense keys and over the block layout),
at each kernel's defaults (matrix-unit products) and, with ``--float32``, on the IEEE float32 path; and HubKV's two
score-refinement kernels at Table 5's largest shape.

Usage (Triton 3.6, as on the device machines)::

    uv pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36:benchmarks python benchmarks/sm90_resources.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sm90_compile_plugin as sm90  # compiles instead of launching (patches Triton's JIT on import)
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages/kv-hqekv/tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--float32", action="store_true", help="the IEEE float32 path instead of the matrix-unit one")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="cache and query dtype")
    ap.add_argument(
        "--kivi-shapes", action="store_true", help="only KIVI's decode-layout kernel, over head dims 64-256, 2-8 bits"
    )
    ap.add_argument(
        "--sass", action="store_true", help="also the machine code's loops: instructions, barriers, MMA per trip"
    )
    args = ap.parse_args()
    sm90.SASS = args.sass
    tc, dtype = not args.float32, getattr(torch, args.dtype)
    if args.kivi_shapes:
        return kivi_shapes(tc, dtype)
    from test_kernels import _plan  # HqeKV's random block-aligned tier plan

    from kv_hex import HEXConfig, HEXStore, hex_tiers
    from kv_hex.kernels.triton_attention import part_attention_triton
    from kv_hqekv import HqeKVStore
    from kv_hqekv.attention import tiered_sides
    from kv_hqekv.kernels.triton_attention import tiered_attention_triton
    from kvcodec import QuantizedSegment, UniformQuantizer
    from kvcodec.kernels.triton_attention import quantized_attention_triton
    from kvcore import Plan

    g = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 8, 16384, 128
    k, v = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
    q = torch.randn(B, 32, 1, D).to(dtype)
    seg = QuantizedSegment.from_dense(
        UniformQuantizer(2, "channel", 32).quantize(k), UniformQuantizer(2, "token", 32).quantize(v)
    )
    quantized_attention_triton(q, seg, 0.1, tensor_cores=tc)
    # KIVI's decode layout (KIVIStore while decoding: 2-bit, G 32, residual 128)
    from bench_fused_attend import layout_store

    from kv_baselines.quant.kivi_decode_triton import decode_attention_triton

    kv = layout_store(k, v, 2)
    decode_attention_triton(kv._dec, q.view(B * H, 4, D), 0.1, tensor_cores=tc)
    hq = HqeKVStore(block=32)
    hq.write(k, v, _plan(g, B, H, T, 32), torch.arange(T).expand(B, T))
    tiered_attention_triton(q, *tiered_sides(hq), 0.1, tensor_cores=tc)
    # the same kernel over the block layout the store keeps between re-plans (whole blocks and a 40-token tail)
    from kv_hqekv.kernels.triton_attention import blocked_attention_triton
    from kvcore import FULL

    kt, vt = torch.randn(2, B, H, 40, D, generator=g).to(dtype)
    tail = torch.full((B, H, 40), FULL, dtype=torch.uint8)
    plan = _plan(g, B, H, T, 32)
    plan = Plan(torch.cat([plan.key_bits, tail], -1), torch.cat([plan.bits_for_values, tail], -1))
    hb = HqeKVStore(block=32)
    hb.write(torch.cat([k, kt], 2), torch.cat([v, vt], 2), plan, torch.arange(T + 40).expand(B, T + 40))
    blocked_attention_triton(q, *hb.decode_layout(), 0.1, tensor_cores=tc)
    # HqeKV's re-plan: the window importance (m = 20 queries) over dense keys and straight from the block layout
    from kv_hqekv.kernels.triton_importance import window_importance_blocked_triton, window_importance_triton

    window = torch.randn(B, 32, 20, D, generator=g).to(dtype)
    window_importance_triton(window, k, tensor_cores=tc)
    if tc:  # the re-plan reads the block layout on the matrix units only (float32 caches take the dense keys)
        layout, key_side, _ = hb.decode_layout()
        window_importance_blocked_triton(window, layout, key_side, tensor_cores=tc)
    keep = torch.ones(B, H, T, dtype=torch.bool)
    hx = HEXStore(HEXConfig(bits=3))
    hx.write(k, v, Plan(hex_tiers(torch.rand(B, H, T, generator=g), keep, torch.zeros_like(keep), 3, 0.02, 8, 96)),
             torch.arange(T).expand(B, T))  # fmt: skip
    part_attention_triton(q, hx._layouts()[0], 0.1, logits=True, tensor_cores=tc)
    # HEX's uniform kernel: the prompt's segment addressed by arithmetic with a 40-token residual, one launch
    from kv_hex.kernels.triton_uniform import uniform_attention_triton
    from kv_hex.uniform import UniformCall, uniform_part

    res = torch.randn(2, B * H, 40, D, generator=g).to(dtype)
    call = UniformCall(uniform_part(hx.config, hx._segments[0]), res[0], res[1], res_logits=True)
    uniform_attention_triton(q, [call], 0.1, tensor_cores=tc)
    # its other variants: HEX-4 KCVT (no mask), per-head value statistics, full mode's segment logits, a stack of two
    from kv_hex.segment import stack_segments

    kc = HEXStore(HEXConfig(bits=4, mask_kind="none", value_scope="head", mode="full"))
    kc.write(k[:, :, :4096], v[:, :, :4096], Plan(hex_tiers(torch.rand(B, H, 4096, generator=g), keep[..., :4096],
             torch.zeros_like(keep[..., :4096]), 4, 0.02, 8, 96)), torch.arange(4096).expand(B, 4096))  # fmt: skip
    seg = kc._segments[0]
    calls = [UniformCall(uniform_part(kc.config, stack_segments([seg, seg])), stack=2, seg_logits=True)]
    uniform_attention_triton(q, calls, 0.1, tensor_cores=tc)
    # SEKV's Stage-1 attention (biased, over resident + coarse entries) at the same shape, keys and values views of
    # a growing buffer as the store passes them
    from kv_sekv.kernels.triton_attention import biased_attention_triton

    kb, vb = torch.randn(2, B, H, T + 100, D, generator=g).to(dtype)
    biased_attention_triton(kb[:, :, :T], vb[:, :, :T], torch.zeros(B, H, T), q, 0.1)
    biased_attention_triton(kb[:, :, :T], vb[:, :, :T], None, q, 0.1)  # a bias-free resident view (no bias read)
    # SEKV's routing gate (projection, gate, threshold) over 512 spans, d' = 32, and Stage 2 over 64 expanded spans
    # of up to 512 tokens at rank 32
    from kv_sekv.kernels.triton_attention import factored_items_triton
    from kv_sekv.kernels.triton_routing import routing_priority_triton

    M = 512
    summary = torch.nn.functional.normalize(torch.randn(B, 32, M, 32, generator=g), dim=-1).to(dtype)
    lengths, alive = torch.randint(1, 64, (B, M), generator=g), torch.ones(B, H, M, dtype=torch.bool)
    routing_priority_triton(q, torch.randn(32, 32, D, generator=g), torch.full((32,), 0.5), summary, lengths, alive)
    factors = [(torch.randn(512, 32, generator=g), torch.rand(32, generator=g), torch.randn(32, D, generator=g))] * 64
    factored_items_triton(torch.randn(64, 4, 1, D, generator=g), factors, factors, 0.1)
    # SEKV's prefill kernels: the surprisal of a 4,096-token prompt over Llama-3-8B's vocabulary (LM head on the
    # matrix units in the cache dtype, IEEE float32 with --float32), and the coarse entries of 64-token spans
    from kv_sekv.kernels.triton_summaries import coarse_entries_triton
    from kv_sekv.kernels.triton_surprisal import surprisal_triton

    hidden, lm_head = torch.randn(1, 4096, 4096, generator=g).to(dtype), torch.randn(128256, 4096).to(dtype)
    surprisal_triton(hidden, lm_head, torch.randint(0, 128256, (1, 4096), generator=g), tensor_cores=tc)
    coarse_entries_triton(k[0], torch.arange(T) // 64, torch.rand(T, generator=g), T // 64)
    # HubKV's score refinement at the paper's largest Table 5 shape (36 layers x 4 rows x 8 heads x 32k tokens)
    from kv_hubkv.config import HubKVConfig
    from kv_hubkv.triton_kernel import _default_block_n, refine_triton_config

    n = 32768
    scores = torch.rand(36, 4, 8, n, generator=g).to(torch.bfloat16)
    prot = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    prot[..., :4] = True
    bn = _default_block_n(n, 8, 36 * 4, torch.device("cuda"))
    refine_triton_config(scores, 0.95, prot, HubKVConfig(), block_n=bn, num_warps=8, check="deferred")
    what = f"matrix units ({args.dtype})" if tc else "IEEE float32"
    print(f"sm_90, Triton {sm90.triton.__version__}, {what} products")
    for key, result in sm90.REPORT.items():
        print(f"{key.split(' ')[0].rsplit('.', 1)[-1]:32s} {result}")


def kivi_shapes(tc: bool, dtype: torch.dtype) -> None:
    """KIVI's decode-layout kernel at its default tiles over head dims (SmolLM2, Llama-3-8B, Gemma) and widths."""
    from bench_fused_attend import layout_store

    from kv_baselines.quant.kivi_decode_triton import decode_attention_triton

    g = torch.Generator().manual_seed(0)
    print(f"sm_90, Triton {sm90.triton.__version__}, KIVI decode layout, 4,096 tokens, {str(dtype)[6:]}")
    for D, Hq, H in ((64, 9, 3), (128, 32, 8), (256, 16, 8)):
        for bits in (2, 4, 8):
            sm90.REPORT.clear()
            kv = layout_store(*torch.randn(2, 1, H, 4097, D, generator=g).to(dtype), bits)
            decode_attention_triton(kv._dec, torch.randn(H, Hq // H, D).to(dtype), 0.1, tensor_cores=tc)
            print(f"D={D:<4d} bits={bits}  " + "  ".join(r for k, r in sm90.REPORT.items() if "kivi" in k))


if __name__ == "__main__":
    main()
