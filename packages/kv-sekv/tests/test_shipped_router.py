"""The router shipped for SmolLM2-135M: it loads (checksum and shapes checked), it is trained (not the untrained
init), it fits SmolLM2-135M's config and refuses other shapes with an error naming ``kv-sekv train``, and
``kv_sekv.sekv()`` compresses and attends a SmolLM2-shaped layer with it, no download involved."""

import json

import pytest
import torch
from sekv_testkit import context

import kv_sekv
from kv_sekv import SEKVConfig, SEKVRouter, ShippedRouter

SMOLLM2 = {  # HuggingFaceTB/SmolLM2-135M-Instruct, config.json
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}


@pytest.fixture(scope="module")
def shipped():
    return ShippedRouter().resolve()


def test_the_artifact_is_small_and_described(shipped):
    path = ShippedRouter().path()
    meta = json.loads(path.with_suffix(".json").read_text())
    assert path.stat().st_size < 3_000_000  # W (30·9·32·64 floats) + τ + g_φ, float32
    assert meta["model_id"] == shipped.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (shipped.num_layers, shipped.num_heads, shipped.num_kv_heads, shipped.head_dim) == (30, 9, 3, 64)
    assert shipped.config.max_rank == SEKVConfig().max_rank and shipped.config.proj_dim == SEKVConfig().proj_dim


def test_the_shipped_router_is_trained(shipped):
    init = SEKVRouter.untrained(30, 9, 3, 64, shipped.config, shipped.model_id)
    assert not torch.equal(shipped.W, init.W)
    assert not torch.equal(shipped.tau, init.tau)
    assert not torch.equal(shipped.gate.net[-1].weight, init.gate.net[-1].weight)
    assert bool(torch.isfinite(shipped.W).all()) and bool(((shipped.tau > -1) & (shipped.tau < 2)).all())


def test_it_fits_smollm2_and_refuses_other_models(shipped):
    transformers = pytest.importorskip("transformers")
    shipped.check_config(transformers.LlamaConfig(**SMOLLM2))  # no weights, no download
    for change in ({"num_key_value_heads": 9}, {"num_hidden_layers": 24}, {"head_dim": 32}):
        with pytest.raises(ValueError, match="kv-sekv train"):
            shipped.check_config(transformers.LlamaConfig(**(SMOLLM2 | change)))
    with pytest.raises(TypeError, match="config"):
        shipped.check_config({"num_hidden_layers": 30})


def test_sekv_works_out_of_the_box_on_a_smollm2_layer(shipped):
    method = kv_sekv.sekv()  # the shipped router, the paper's 10 % budget
    ctx = context(
        Hkv=3, T=640, D=64, layer=29, surprisal=torch.rand(1, 640, generator=torch.Generator().manual_seed(3)) * 6
    )
    store = method.compress(ctx)
    assert store._spans is not None and store.used[0] <= 0.1
    out, lse = store.attend(torch.randn(1, 9, 1, 64))
    assert out.shape == (1, 9, 1, 64) and bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    with pytest.raises(ValueError, match="kv-sekv train"):  # a cache of another model's shape
        kv_sekv.sekv().compress(context(Hkv=2, T=640, D=64, layer=0, surprisal=ctx.extras["surprisal"]))
