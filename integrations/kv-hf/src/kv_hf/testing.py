"""Tiny random causal LMs for tests of anything that runs through kv_hf (no download, a few milliseconds).

``tiny_model()`` is a 2-layer, hidden-64, 4 query / 2 KV heads, head_dim-16 model in float32, eval mode, built from
a seed (``tiny_model("gemma3")``: the same with a sliding-window layer of 8 tokens before its global layer).
Method packages' adapter tests, kvbench's and kv_hf's own share it instead of each building one.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = ["FAMILIES", "TINY", "tiny_model"]

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
"""The tiny configuration (every key can be overridden in :func:`tiny_model`)."""

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"sliding_window": 8}),
}
"""Model families kv_hf supports: config class, model class, family-specific settings. ``"gemma3"`` is hybrid:
sliding-window layers of 8 tokens alternate with global layers (layer 0 sliding), unless ``layer_types`` is given."""


def tiny_model(family: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides: Any):
    """A random :data:`TINY` causal LM of ``family`` with ``overrides``, in float32 and eval mode.

    The weights depend only on ``seed`` and the configuration (``torch.manual_seed(seed)`` right before building).

    Raises
    ------
    ValueError
        For a family not in :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    config_cls, model_cls, extra = FAMILIES[family]
    settings = {**TINY, **extra, **overrides}
    if family == "gemma3" and "layer_types" not in overrides:
        n = settings["num_hidden_layers"]
        settings["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    torch.manual_seed(seed)
    config = config_cls(**settings)
    config._attn_implementation = attn
    model = model_cls(config).eval()
    model.set_attn_implementation(attn)
    return model
