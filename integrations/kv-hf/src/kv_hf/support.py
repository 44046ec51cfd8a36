"""Which models and compressors the transformers adapter can serve, with errors that say what is missing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_hf import providers
from kv_hf.implementations import KV_HF_IMPLEMENTATIONS
from kvcore import Compressor
from kvcore.checks import check_int

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from kv_hf.options import CacheOptions

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})
"""Families whose attention modules call ``past_key_values.update(k, v, layer_idx)`` with post-RoPE K/V and
dispatch through transformers' ``ALL_ATTENTION_FUNCTIONS`` with ``position_ids`` — the two hooks kv_hf needs."""

_KERNELS = ("sdpa", "eager", *KV_HF_IMPLEMENTATIONS)

DEFAULT_QUERY_WINDOW = 64
"""Queries captured when neither the options nor the scorer say otherwise (kvpress ``window_size=64``)."""


def resolve_query_window(compressor: Compressor, options: CacheOptions) -> int | None:
    """How many trailing post-RoPE queries a cache captures per layer; ``None`` = every prompt query.

    A scorer declares what it needs with its ``query_window`` attribute (``kvcore.Scorer``): an int (SnapKV's
    observation window) or ``None`` (H2O: every prompt query). An explicit ``options.query_window`` wins, but may not be
    shorter than a window the scorer asks for (it would silently score with fewer queries): ``ValueError``.
    Otherwise the largest window asked for by the compressor or the re-compressor is captured, else
    :data:`DEFAULT_QUERY_WINDOW`.
    """
    asks = []
    for comp in (compressor, options.recompressor):
        if comp is None or not comp.scorer.needs_queries:
            continue
        declared = comp.scorer.query_window
        check_int(f"{type(comp.scorer).__name__}.query_window", declared, low=1, optional="every prompt query")
        asks.append(declared)
    if options.query_window is not None:
        longer = [w for w in asks if w is not None and w > options.query_window]
        if longer and options.query_window > 0:
            raise ValueError(
                f"the scorer asks for its last {max(longer)} queries but query_window={options.query_window}; "
                f"raise query_window to >= {max(longer)} or leave it unset (the scorer's own window is used)"
            )
        return options.query_window
    if any(w is None for w in asks):
        return None
    return max(asks, default=DEFAULT_QUERY_WINDOW)


def text_config(model: PreTrainedModel) -> PretrainedConfig:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model: object) -> PretrainedConfig:
    """Raise unless ``model`` is a supported causal LM whose layers kv_hf serves (global attention, and sliding-window
    layers beside them) with an SDPA/eager kernel.

    Returns the (text) config.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    config = check_config(text_config(model))
    impl = config._attn_implementation or "sdpa"
    if impl not in _KERNELS:
        raise ValueError(
            f"attention implementation {impl!r} is not supported: flash-attention and flex kernels cannot add the "
            "per-head logit bias of a compressed layout; load the model with attn_implementation='sdpa' or 'eager'"
        )
    return config


def check_config(config: PretrainedConfig) -> PretrainedConfig:
    """Raise unless a (text) config describes a model kv_hf serves: a supported family whose layers are global
    attention, or sliding-window layers beside them (the checks of :func:`check_model` a config alone can answer,
    e.g. before any weights are loaded).

    Returns ``config``.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"kv_hf supports the model types {sorted(SUPPORTED_MODEL_TYPES)}, got {model_type!r}: a supported "
            "architecture must call past_key_values.update(k, v, layer_idx) with post-RoPE keys and dispatch "
            "attention through ALL_ATTENTION_FUNCTIONS with position_ids"
        )
    layer_kinds(config)
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            f"kv_hf compresses full-attention layers only; this Mistral config has sliding_window="
            f"{config.sliding_window} (set config.sliding_window = None for full attention)"
        )
    return config


LAYER_KINDS = {"full_attention": "compressed", "sliding_attention": "window"}
"""transformers' layer types kv_hf serves: global layers are compressed, sliding-window layers keep their window."""


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """Per layer, ``"compressed"`` (global attention: a Store) or ``"window"`` (sliding attention: kept as
    transformers keeps it, :class:`kv_hf.window.WindowLayer`).

    Raises ``ValueError`` naming the first layer kv_hf cannot serve (an unknown layer type, a sliding layer without
    a window) and when no layer is global (nothing would be compressed).
    """
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
    if len(layer_types) != n:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {n} layers")
    kinds = []
    for i, kind in enumerate(layer_types):
        if kind not in LAYER_KINDS:
            raise ValueError(
                f"layer {i} is {kind!r} attention: kv_hf serves {sorted(LAYER_KINDS)} layers (global layers are "
                "compressed, sliding-window layers keep their window)"
            )
        if LAYER_KINDS[kind] == "window" and not getattr(config, "sliding_window", None):
            raise ValueError(f"layer {i} is sliding-window attention but config.sliding_window is {None!r}")
        kinds.append(LAYER_KINDS[kind])
    if "compressed" not in kinds:
        raise ValueError(
            "every layer of this model is sliding-window attention: each keeps only its window already, and kv_hf "
            "compresses global-attention layers only"
        )
    return kinds


def check_compressor(compressor: object, options: CacheOptions) -> Compressor:
    """Raise unless the adapter can supply everything ``compressor`` (and the re-compressor) declares it needs."""
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a kvcore.Compressor, got {type(compressor).__name__}")
    _check_needs(compressor, options, "compressor", providers.provided())
    if options.recompressor is not None or options.recompress_every or (options.replan and compressor.replan_every):
        re = options.recompressor or compressor
        if re.budget.granularity == "global":
            raise ValueError(
                "periodic re-compression runs per layer; budget granularity 'global' is not supported there "
                "(use 'head' or 'layer' for the re-compressor)"
            )
        _check_needs(re, options, "recompressor", frozenset())
    return compressor


def _check_needs(compressor: Compressor, options: CacheOptions, what: str, provided: frozenset[str]) -> None:
    scorer = compressor.scorer
    name = type(scorer).__name__
    missing = sorted(set(scorer.needs_extras) - provided)
    if missing:
        hint = (
            f"kv_hf.prefill supplies {providers.describe()}" if provided else "no extras are available while decoding"
        )
        raise ValueError(f"{what} scorer {name} needs extras {missing} that the kv_hf adapter cannot supply ({hint})")
    if scorer.needs_queries and options.query_window == 0:
        raise ValueError(f"{what} scorer {name} needs queries: set query_window >= 1 or leave it unset (got 0)")
