"""Decode attention v2 over HEX's uniform segments (the folded formulation, issue 43): the Triton kernel (interpreter
on CPU: small shapes, few large program blocks; compiled on a GPU) and its PyTorch reference agree with attention
over the store's dequantized entries within docs/protocols.md's tolerance contract (kvcodec.decode_v2.OUT_RTOL /
LSE_ATOL): 2-, 3- and 4-bit codes, the expander overlay (or none), value statistics per token across heads or per
head, a stack of segments and a segment with the residual in one merge, the accumulator's logits; at Gemma 3's
(d 256, 1 KV head) and SmolLM2's (d 64, 3 KV heads) head shapes."""

import pytest
import torch

import kv_hex
from kv_hex.kernels import dispatch, reference
from kv_hex.kernels.folded import attention_over_dequantized, contract_errors, uniform_decode_v2, uniform_decode_v2_ref
from kv_hex.segment import stack_segments
from kv_hex.uniform import UniformCall, uniform_part
from kvcodec.decode_v2 import LSE_ATOL, OUT_RTOL, within_tolerance
from kvcore import ScoringContext, reference_attention

triton = pytest.importorskip("triton")

from kv_hex.kernels.triton_folded import supported, uniform_decode_v2_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_store(seed, B, H, T, D, dtype, group=2, **cfg):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, H, T, D, generator=g) * 2 + torch.randn(B, H, 1, D, generator=g)).to(dtype).to(DEVICE)
    v = torch.randn(B, H, T, D, generator=g).to(dtype).to(DEVICE)
    qs = torch.randn(B, H * group, T, D, generator=g).to(dtype).to(DEVICE)
    return kv_hex.hex(**cfg).compress(ScoringContext(keys=k, values=v, queries=qs)), g


def prompt_call(store, logits=True):
    """The call ``attend`` makes on CUDA for the prompt's segment and the residual."""
    B, H, D = store._shape
    TR = store._residual_T()
    part = uniform_part(store.config, store._segments[0])
    assert part is not None
    rk = store._res["k"].view(B * H, TR, D) if TR else None
    rv = store._res["v"].view(B * H, TR, D) if TR else None
    return UniformCall(part, rk, rv, seg_logits=logits, res_logits=logits)


def check(q, calls, scale, **kernel):
    """The contract for the kernel and the reference; the two agree within half of it, and so do their logits."""
    out, lse, lg = uniform_decode_v2_triton(q, calls, scale, **kernel)
    r_out, r_lse, r_lg = uniform_decode_v2_ref(q, calls, scale)
    for o, s in ((out, lse), (r_out, r_lse)):
        e = contract_errors(o, s, q, calls, scale)
        assert e["out_f32"] <= OUT_RTOL and e["lse_f32"] <= LSE_ATOL, e
        assert e["out_ratio"] <= 1 and e["lse_ratio"] <= 1, e
    D = q.shape[-1]
    rel, dl = within_tolerance(out.reshape(-1, 1, D), lse.reshape(-1, 1, 1), r_out.reshape(-1, 1, D),
                               r_lse.reshape(-1, 1, 1))  # fmt: skip
    assert rel <= OUT_RTOL / 2 and dl <= LSE_ATOL / 2
    for (a, b), (c, d) in zip(lg, r_lg):
        for x, y in ((a, c), (b, d)):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(x, y, atol=2e-3, rtol=1e-3)
    # the contract's "read()" side is the current uniform path's attention (over read()'s entries)
    p_out, p_lse, _ = reference.uniform_attention(q, calls, scale)
    a_out, a_lse = attention_over_dequantized(q, calls, scale)
    torch.testing.assert_close(a_out, p_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a_lse, p_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("bits", "dtype", "value_scope", "mask_kind", "T"),
    [
        (3, torch.float16, "layer", "expander", 200),
        (3, torch.bfloat16, "head", "random", 100),
        (4, torch.bfloat16, "layer", "expander", 96),
        (2, torch.float16, "head", "none", 101),
    ],
)
def test_kernel_and_reference_within_the_contract(bits, dtype, value_scope, mask_kind, T):
    """The prompt's segment with the residual (or without one), every overlay and value-statistics scope."""
    store, g = make_store(bits, 1, 2, T, 64, dtype, bits=bits, value_scope=value_scope, mask_kind=mask_kind)
    q = torch.randn(1, 4, 1, 64, generator=g).to(dtype).to(DEVICE)
    check(q, [prompt_call(store)], 0.125, max_blocks=4)


def test_a_stack_and_a_segment_in_one_merge():
    """Two calls in one launch series and one merge: a stack of two 96-slot segments (query repeated per segment in
    the kernel's addressing) and the prompt's segment with the residual."""
    segs = []
    for seed in (1, 2):
        s, _ = make_store(seed, 2, 2, 96, 64, torch.float16, bits=3)
        segs.append(s._segments[0])
    store, g = make_store(3, 2, 2, 100, 64, torch.float16, bits=3)
    stack = uniform_part(store.config, stack_segments(segs))
    calls = [UniformCall(stack, stack=2, seg_logits=True), prompt_call(store)]
    q = torch.randn(2, 4, 1, 64, generator=g).half().to(DEVICE)
    check(q, calls, 0.125, max_blocks=4)


@pytest.mark.parametrize(
    ("name", "H", "group", "D", "dtype"),
    [("gemma3", 1, 4, 256, torch.bfloat16), ("smollm2", 3, 3, 64, torch.float16)],
)
def test_model_shapes(name, H, group, D, dtype):
    """Gemma 3 (head dim 256, one KV head, 4 query heads) and SmolLM2 (head dim 64, 3 KV heads, GQA group 3), HEX-3
    at its block of 96 with a residual; two query rows per head."""
    store, g = make_store(7, 1, H, 100, D, dtype, group=group, bits=3)
    q = torch.randn(1, H * group, 2, D, generator=g).to(dtype).to(DEVICE)
    check(q, [prompt_call(store)], D**-0.5, max_blocks=4)


def test_dispatch_and_store_decode_path(monkeypatch):
    """The dispatcher takes the reference off CUDA and for calls the kernel does not take (float32); ``attend`` keeps
    its exact path on CPU whatever the flag."""
    store, g = make_store(5, 1, 2, 100, 64, torch.float32, bits=3)
    q = torch.randn(1, 4, 1, 64, generator=g).to(DEVICE)
    calls = [prompt_call(store)]
    assert not supported(q, calls)
    for a, b in zip(uniform_decode_v2(q, calls, 0.125)[:2], uniform_decode_v2_ref(q, calls, 0.125)[:2]):
        torch.testing.assert_close(a, b)
    monkeypatch.setattr(dispatch, "FOLDED_DECODE", True)
    out, lse = store.attend(q, 0.125)
    ref_out, ref_lse = reference_attention(store.read(), q, 0.125)
    if DEVICE == "cpu":
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
