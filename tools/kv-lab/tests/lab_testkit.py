"""Shared helpers of the kv-lab tests: a tiny random Llama for the training and CLI tests."""

from __future__ import annotations

import torch


def tiny_llama(vocab: int = 128, init: float = 0.02):
    """A seeded 2-layer random Llama (4 query heads, 2 KV heads, head dim 8) for training and CLI tests."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        initializer_range=init,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()
