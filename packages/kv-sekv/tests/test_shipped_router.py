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
    return ShippedRouter("smollm2-135m").resolve()


def test_the_artifact_is_small_and_described(shipped):
    path = ShippedRouter("smollm2-135m").path()
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


def test_the_default_source_chooses_the_shipped_router_by_the_cache_shape(shipped):
    source = ShippedRouter()  # what kv_sekv.sekv() uses
    assert source.resolve(3, 64) is source.resolve(3, 64)  # loaded once
    assert source.resolve(3, 64).model_id == shipped.model_id
    listed = kv_sekv.shipped_routers()
    assert "smollm2-135m" in listed and listed["smollm2-135m"]["num_kv_heads"] == 3
    with pytest.raises(ValueError, match="smollm2-135m"):  # no shape: it says which routers are shipped
        source.resolve()
    with pytest.raises(ValueError, match=r"no shipped router fits a cache of 2 KV heads of dim 64.*kv-sekv train"):
        source.resolve(2, 64)


def test_two_shipped_routers_of_one_shape_are_refused_unless_named(tmp_path, monkeypatch):
    import kv_sekv.router as router_module

    for name in ("a", "b"):
        SEKVRouter.untrained(2, 4, 2, 16, model_id=name).save(tmp_path / f"{name}.safetensors")
    monkeypatch.setattr(router_module, "ROUTERS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"the shipped routers \['a', 'b'\] all fit"):
        ShippedRouter().resolve(2, 16)
    assert ShippedRouter("b").resolve(2, 16).model_id == "b"
    with pytest.raises(TypeError, match="name must be"):
        ShippedRouter(3)


def test_untrained_and_global_tau_sources_follow_the_shape_choice(shipped):
    untrained = kv_sekv.UntrainedRouter().resolve(3, 64)
    assert (untrained.num_layers, untrained.num_heads, untrained.model_id) == (30, 9, shipped.model_id)
    glob = kv_sekv.GlobalThresholdRouter().resolve(3, 64)
    torch.testing.assert_close(glob.tau, torch.full_like(glob.tau, float(shipped.tau.detach().mean())))
    with pytest.raises(ValueError, match="kv-sekv train"):
        kv_sekv.UntrainedRouter().resolve(2, 64)
    with pytest.raises(TypeError, match="like must be"):
        kv_sekv.UntrainedRouter(like="smollm2-135m")


GEMMA3_270M = {  # google/gemma-3-270m, config.json (text part)
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
}


def test_the_gemma_router_is_shipped_trained_and_chosen_for_a_gemma_layer():
    transformers = pytest.importorskip("transformers")
    gemma = ShippedRouter().resolve(num_kv_heads=1, head_dim=256)
    assert gemma.model_id == "google/gemma-3-270m"
    gemma.check_config(transformers.Gemma3TextConfig(**GEMMA3_270M))  # no weights, no download
    init = SEKVRouter.untrained(18, 4, 1, 256, gemma.config, gemma.model_id)
    assert not torch.equal(gemma.W, init.W) and not torch.equal(gemma.tau, init.tau)
    assert ShippedRouter("gemma3-270m").path().stat().st_size < 4_000_000
    # kv_sekv.sekv() picks it for a Gemma-shaped global layer (layer 5) and the SmolLM2 one for a SmolLM2 layer
    method = kv_sekv.sekv()
    h = torch.rand(1, 640, generator=torch.Generator().manual_seed(4)) * 6
    store = method.compress(context(Hkv=1, T=640, D=256, layer=5, surprisal=h))
    assert store._spans is not None and store.used[0] <= 0.1
    out, lse = store.attend(torch.randn(1, 4, 1, 256))
    assert out.shape == (1, 4, 1, 256) and bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    smol = method.compress(context(Hkv=3, T=640, D=64, layer=29, surprisal=h))
    assert smol._spans is not None


def test_the_shape_choice_reads_the_sidecars_once_per_shape(monkeypatch):
    """Invariant: resolve() is called for every layer and decode step; the shipped list is read once per shape."""
    import kv_sekv.router as router_module

    reads = []
    real = router_module.shipped_routers
    monkeypatch.setattr(router_module, "shipped_routers", lambda: reads.append(1) or real())
    source = ShippedRouter()
    first = source.resolve(3, 64)
    assert all(source.resolve(3, 64) is first for _ in range(5)) and len(reads) == 1
