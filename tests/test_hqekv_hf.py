"""HqeKV through the HF adapter on its GPU path (forced on here; Triton's interpreter on CPU): a float16 decode across
re-plans equals the CPU path's."""

import pytest
import torch

kv_hf = pytest.importorskip("kv_hf")
kv_hqekv = pytest.importorskip("kv_hqekv")
pytest.importorskip("triton")
from kv_hf.testing import tiny_model
from kvcore import value_checks


def _decode(model, ids, steps):
    comp = kv_hqekv.hqekv(2.0, config=kv_hqekv.HqeKVConfig(block=8, period=8, fp16_blocks=1))
    cache = kv_hf.compressed_cache(model, comp)
    logits = [kv_hf.prefill(model, cache, ids).float()]
    with value_checks(False):  # as on a GPU
        for _ in range(steps):
            nxt = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(nxt, past_key_values=cache).logits[:, -1].float())
    return torch.stack(logits), [layer.store for layer in cache.layers]


@torch.no_grad()
def test_a_float16_decode_on_the_fused_path_equals_the_cpu_path_across_replans(monkeypatch):
    """Blocks of 8 re-planned every 8 tokens: the fused path decodes through the block layout (attention and the
    re-plan's window read from the held codes) and gives the CPU path's tokens, logits within float16 rounding and
    the same tiers after two re-plans; the layout is kept by every layer."""
    from kv_hqekv import attention, importance, window
    from kv_hqekv.kernels import dispatch

    model = tiny_model().to(torch.float16)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    want, cpu_stores = _decode(model, ids, 18)
    for mod in (attention, importance, window, dispatch):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    dense = window._dense_keys

    def no_dense_keys(*args, **kwargs):
        raise AssertionError("a float16 re-plan on the fused path built the dense keys")

    monkeypatch.setattr(window, "_dense_keys", no_dense_keys)
    got, stores = _decode(model, ids, 18)
    monkeypatch.setattr(window, "_dense_keys", dense)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    for fused, cpu in zip(stores, cpu_stores):
        assert fused._blocks and cpu._blocks is None
        held, ref = fused.tiers(), cpu.tiers()
        assert torch.equal(held.key_bits, ref.key_bits) and torch.equal(held.bits_for_values, ref.bits_for_values)
        assert bool((held.key_bits != 16).any()), "blocks below fp16 are held"
