"""HqeKV through the transformers adapter (kv-hf) on a tiny random Llama: the all-fp16 plan is the unmodified
model, the paper's shares compress for real. Skipped where kv-hf / transformers are not installed (the package
itself does not depend on them)."""

import dataclasses

import pytest
import torch

kv_hf = pytest.importorskip("kv_hf")
transformers = pytest.importorskip("transformers")

from kv_hf.testing import tiny_model
from kv_hqekv import HqeKVConfig, HqeKVStore, hqekv


def tiny_llama():
    return tiny_model(head_dim=32, max_position_embeddings=1024)


def ids(T, seed=1):
    return torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(seed))


class ReadPathStore(HqeKVStore):
    can_attend = False  # decode through read() + reference attention instead of the fused attend


@pytest.mark.parametrize("fused", [False, True], ids=["read-path", "fused-attend"])
@torch.no_grad()
def test_all_fp16_plan_gives_the_models_logits(fused):
    """With every planned block fp16 (fp16_blocks larger than the context), prefill logits equal the model with an
    ordinary cache bit for bit, and so do decode logits through read(); the fused attend (split per tier pair and
    merged by log-sum-exp) equals them to float rounding."""
    model = tiny_llama()
    x = ids(100)
    ref_cache = transformers.DynamicCache(config=model.config)
    c = hqekv(2.0, config=HqeKVConfig(fp16_blocks=10**6))
    if not fused:
        c = dataclasses.replace(c, store=ReadPathStore)
    cache = kv_hf.compressed_cache(model, c)
    a, b = model(x, past_key_values=ref_cache), model(x, past_key_values=cache)
    assert torch.equal(a.logits, b.logits)
    for _ in range(5):
        tok = a.logits[:, -1:].argmax(-1)
        a, b = model(tok, past_key_values=ref_cache), model(tok, past_key_values=cache)
        if fused:
            assert torch.allclose(a.logits, b.logits, atol=1e-5, rtol=0)
        else:
            assert torch.equal(a.logits, b.logits)


@torch.no_grad()
def test_prefill_compresses_for_real():
    """kv_hf.prefill with hqekv-2 holds fewer bytes than fp16, keeps the tail as fp16 and decodes finite logits."""
    model = tiny_llama()
    x = ids(300)
    cache = kv_hf.compressed_cache(model, hqekv(2.0))
    logits = kv_hf.prefill(model, cache, x)
    assert bool(torch.isfinite(logits).all())
    fp16_bytes = 2 * 2 * 2 * 300 * 32 * 4  # layers x (K, V) x heads x tokens x dim x float32
    assert cache.nbytes() < fp16_bytes / 2  # 76 of 300 entries stay full precision at this short length
    counts = cache.layers[0].store.tier_counts()
    assert int(counts["keys_16"][0, 0]) == 2 * 32 + 300 % 32  # two fp16 blocks + the residual tail
    out = model(x[:, -1:], past_key_values=cache)
    assert bool(torch.isfinite(out.logits).all())


@torch.no_grad()
def test_kv_hf_retiers_every_T_decoded_tokens():
    """Through the normal adapter path (no target, no kv_hqekv call): the compressor's replan_every = T = 32 makes
    kv-hf re-tier every 32 decoded tokens. Bits never increase, an evicted position never returns, logits stay
    finite, and the held bytes fall at each flush (the residual's 32 fp16 tokens are quantized)."""
    model = tiny_llama()
    cache = kv_hf.compressed_cache(model, hqekv(2.0))
    logits = kv_hf.prefill(model, cache, ids(256))
    rank = torch.tensor([0, 1, 2, 0, 3] + [0] * 11 + [4])

    def held(layer):  # true position -> (key rank, value rank) of head 0 of row 0
        view, t = layer.store.read(), layer.store.tiers()
        pos = view.positions[0, 0].tolist()
        kr, vr = rank[t.key_bits[0, 0].long()].tolist(), rank[t.bits_for_values[0, 0].long()].tolist()
        return {p: (kr[i], vr[i]) for i, p in enumerate(pos) if p >= 0}

    before = [held(layer) for layer in cache.layers]
    gone: list[set] = [set() for _ in cache.layers]
    tok = (logits if logits.ndim == 2 else logits[:, -1]).argmax(-1, keepdim=True)
    for step in range(1, 65):
        nbytes = cache.nbytes()
        out = model(tok, past_key_values=cache)
        assert bool(torch.isfinite(out.logits).all())
        tok = out.logits[:, -1:].argmax(-1)
        assert all(layer.recompressions == step // 32 for layer in cache.layers)
        if step % 32 == 0:
            assert cache.nbytes() < nbytes, "a flush must quantize the residual"
            for i, layer in enumerate(cache.layers):
                now = held(layer)
                for p, (k, v) in now.items():
                    assert p not in gone[i], f"evicted position {p} came back"
                    if p in before[i]:
                        assert k <= before[i][p][0] and v <= before[i][p][1], "bits increased"
                gone[i] |= set(before[i]) - set(now)
                before[i] = now
    counts = cache.layers[0].store.tier_counts()
    assert int(counts["keys_16"][0, 0]) < 2 * 32 + 64  # the decoded tokens were tiered, not kept fp16
