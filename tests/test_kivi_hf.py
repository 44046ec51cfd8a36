"""KIVI through the HF adapter on its GPU path: the decode-layout kernel and the fused value flush (forced on here;
Triton's interpreter computes them) give the logits of the PyTorch path, step after step."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
kv_hf = pytest.importorskip("kv_hf")
kv_baselines = pytest.importorskip("kv_baselines")
pytest.importorskip("triton")
from kv_baselines.quant import kivi_decode, token_quant
from kv_hf.testing import tiny_model


@torch.no_grad()
def _decode(model, ids, steps: int) -> tuple[torch.Tensor, list]:
    cache = kv_hf.compressed_cache(model, kv_baselines.kivi(2, residual=8, group_size=8))
    logits = [kv_hf.prefill(model, cache, ids)]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(nxt, past_key_values=cache).logits[:, -1])
    return torch.stack(logits), [layer.store for layer in cache.layers]


def test_kivi_decodes_through_the_kernel_with_the_pytorch_paths_logits(monkeypatch):
    # 12 steps with a residual of 8: the value FIFO turns and key blocks are flushed during the decode
    if torch.cuda.is_available():
        pytest.skip("on a GPU both runs would take the kernel; the interpreter comparison is a CPU test")
    model = tiny_model()
    ids = torch.randint(3, 256, (1, 29), generator=torch.Generator().manual_seed(2))
    want, _ = _decode(model, ids, 12)
    calls = []
    real = kivi_decode.DecodeState.attend

    def counted(self, query, scale):
        calls.append(query.shape)
        return real(self, query, scale)

    monkeypatch.setattr(kivi_decode, "use_triton", lambda t: True)
    monkeypatch.setattr(token_quant, "use_triton", lambda t: True)
    monkeypatch.setattr(kivi_decode.DecodeState, "attend", counted)
    got, stores = _decode(model, ids, 12)
    assert len(calls) >= 12 * len(stores)  # every layer decoded every step through the decode layout
    assert all(store._dec is not None for store in stores)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
