"""A tiny random Llama saved at test time (no download): 2 layers, 2 KV heads of 64 (CPU attention needs >= 32)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 512


def save_tiny_llama(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper random model: larger logits make token choices less tie-prone
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path
