"""The names under which kv_hf registers its attention functions with transformers (:mod:`kv_hf.attention`)."""

from __future__ import annotations

KV_HF_SDPA = "kv_hf"
"""transformers' SDPA kernel with kv_hf's per-entry bias, query capture and Store attention."""
KV_HF_EAGER = "kv_hf_eager"
"""The model's eager attention, the same way."""
KV_HF_IMPLEMENTATIONS = (KV_HF_SDPA, KV_HF_EAGER)
"""Every implementation name kv_hf registers."""
