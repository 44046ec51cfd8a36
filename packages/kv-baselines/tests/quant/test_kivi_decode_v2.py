"""kvcodec's decode attention v2 (the folded formulation, issue 43) over a real KIVIStore's decode layout: within the
tolerance contract (docs/protocols.md) of attention over read(), on the interpreter on CPU (compiled on a GPU), with
the layout's buffers taken as they are (PackedKIVI.of_state, no conversion); DecodeState.attend takes it only when
asked (folded=True / FOLDED_DECODE), on CUDA."""

import pytest
import torch

from kv_baselines.quant import KIVIStore, UniformQuantizer, kivi_decode, kivi_tiers
from kvcodec.decode_v2 import LSE_ATOL, OUT_RTOL, PackedKIVI, contract_errors, row_errors
from kvcore import Plan, reference_attention

pytest.importorskip("triton")
from kvcodec.kernels.triton_decode_v2 import kivi_decode_v2_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _store(seed, bits, B, H, T, D, G, R, steps, dtype):
    gen = torch.Generator().manual_seed(seed)
    store = KIVIStore(UniformQuantizer(bits, "channel", G), UniformQuantizer(bits, "token", G), residual=R)
    keep = torch.ones(B, H, T, dtype=torch.bool, device=DEVICE)
    plan = Plan(kivi_tiers(keep, bits, R, "keys"), kivi_tiers(keep, bits, R, "values"))
    k, v = torch.randn(B, H, T, D, generator=gen) * 2, torch.randn(B, H, T, D, generator=gen)
    store.write(k.to(DEVICE, dtype), v.to(DEVICE, dtype), plan, torch.arange(T, device=DEVICE).expand(B, T))
    for i in range(steps):
        nk, nv = torch.randn(B, H, 1, D, generator=gen) * 2, torch.randn(B, H, 1, D, generator=gen)
        store.append(nk.to(DEVICE, dtype), nv.to(DEVICE, dtype), torch.full((B, 1), T + i, device=DEVICE))
    assert store._dec is not None
    return store, gen


@pytest.mark.parametrize(
    ("bits", "dtype", "steps"), [(2, torch.float16, 3), (4, torch.bfloat16, 21), (8, torch.float16, 40)]
)
def test_v2_over_a_kivi_store_is_within_the_contract_of_attention_over_read(bits, dtype, steps):
    # 2 heads of 2 query rows, head dim 64, group 16, residual 32: quantized keys and values, key residual, a value
    # ring that has turned (steps > R) or not
    B, H, M, D = 1, 2, 2, 64
    store, gen = _store(seed=bits, bits=bits, B=B, H=H, T=100, D=D, G=16, R=32, steps=steps, dtype=dtype)
    dec = store._dec
    q = torch.randn(B * H, M, D, generator=gen).to(DEVICE, dtype)
    cache = PackedKIVI.of_state(dec)
    out, lse = kivi_decode_v2_triton(q, cache, 0.2, block_t=16)
    e = contract_errors(out, lse, q, cache, 0.2)
    assert e["out_f32"] <= OUT_RTOL and e["lse_f32"] <= LSE_ATOL and e["out_ratio"] <= 1 and e["lse_ratio"] <= 1, e
    # the contract's reference is read() itself: attention over what the store hands out
    ref_out, ref_lse = reference_attention(store.read(), q.view(B, H * M, 1, D), 0.2)
    rel, dl = row_errors(out.view(B, H * M, 1, D), lse.view(B, H * M, 1), ref_out, ref_lse)
    assert float(rel.max()) <= OUT_RTOL + 2 * e["out"] + 1e-6 and float(dl.max()) <= LSE_ATOL + 2 * e["lse"] + 1e-6


def test_decode_state_takes_v2_only_when_asked(monkeypatch):
    store, gen = _store(seed=1, bits=2, B=1, H=2, T=70, D=64, G=16, R=16, steps=2, dtype=torch.float16)
    q = torch.randn(2, 2, 64, generator=gen).to(DEVICE, torch.float16)
    calls = []
    real = kivi_decode_v2_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton", spy)
    monkeypatch.setattr(kivi_decode, "use_triton", lambda t: True)
    store._dec.attend(q, 0.3)
    assert calls == []  # off by default
    out, lse = store._dec.attend(q, 0.3, folded=True)
    assert calls == [1]
    e = contract_errors(out, lse, q, PackedKIVI.of_state(store._dec), 0.3)
    assert e["out_ratio"] <= 1 and e["lse_ratio"] <= 1, e
    monkeypatch.setattr(kivi_decode, "FOLDED_DECODE", True)
    store._dec.attend(q, 0.3)
    assert calls == [1, 1]
