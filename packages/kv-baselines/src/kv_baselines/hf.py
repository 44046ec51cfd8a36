"""kv-hf extras providers for kv-baselines' scorers (loaded through the ``kvcompress.hf_providers`` entry points).

Only kv-hf imports this module (when it discovers providers), so kv-baselines itself never needs transformers:

* ``"rope_inv_freq"`` — the RoPE inverse frequencies of every compressed layer, read from the model's rotary
  embedding (no forward pass), for :class:`~kv_baselines.ExpectedAttentionScorer`;
* ``"sentence_ids"`` — the prompt's sentence index per token, split after punctuation tokens (the tokenizer's text
  of each id), for :class:`~kv_baselines.SentenceKVScorer`.
"""

from __future__ import annotations

from typing import Any

import torch

from kv_baselines.scorers.expected_attention import ROPE_EXTRA
from kv_baselines.sentence.scorer import SENTENCE_EXTRA
from kv_baselines.sentence.segmentation import is_sentence_end, sentence_ids
from kv_hf.providers import Provider


def _rotary(model: Any) -> Any:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise ValueError(
            f"the {ROPE_EXTRA} provider reads the decoder's rotary embedding (decoder.rotary_emb), which "
            f"{type(decoder).__name__} does not have"
        )
    return rotary


def rope_frequencies(model: Any, layer_idx: int) -> torch.Tensor:
    """``[D_rot / 2]`` float32 inverse frequencies of layer ``layer_idx``: the rotary embedding's ``inv_freq``, or
    ``<layer type>_inv_freq`` for models with one rotary embedding per attention type (Gemma 3's sliding and full
    attention layers)."""
    rotary = _rotary(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(config, "layer_types", None)
    if types is not None and hasattr(rotary, f"{types[layer_idx]}_inv_freq"):
        return getattr(rotary, f"{types[layer_idx]}_inv_freq").detach().float()
    if not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        raise ValueError(f"the rotary embedding {type(rotary).__name__} holds no inv_freq for layer {layer_idx}")
    return rotary.inv_freq.detach().float()


def _check(cache: Any, input_ids: torch.Tensor, attention_mask: Any, tokenizer: Any) -> None:
    """Nothing to check: the frequencies depend on the model only."""


def _provide(model: Any, cache: Any, input_ids: torch.Tensor, **_: Any) -> dict[int, dict[str, Any]]:
    return {layer.layer_idx: {ROPE_EXTRA: rope_frequencies(model, layer.layer_idx)} for layer in cache.compressed}


ROPE = Provider(
    name=ROPE_EXTRA,
    option=ROPE_EXTRA,
    check=_check,
    run=_provide,
    description="the layers' RoPE inverse frequencies from the model's rotary embedding (no forward pass)",
)
"""The ``"rope_inv_freq"`` extras provider."""


def _check_tokenizer(cache: Any, input_ids: torch.Tensor, attention_mask: Any, tokenizer: Any) -> None:
    """The segmentation reads each token's text: a tokenizer with ``decode`` is needed."""
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(
            f"the {SENTENCE_EXTRA} provider splits sentences at punctuation tokens and needs the tokenizer: "
            "kv_hf.prefill(model, cache, ids, tokenizer=tokenizer)"
        )


def _sentences(model: Any, cache: Any, input_ids: torch.Tensor, *, tokenizer: Any, **_: Any) -> dict:
    ids = sentence_ids(input_ids, lambda i: is_sentence_end(tokenizer.decode([i])))
    return {layer.layer_idx: {SENTENCE_EXTRA: ids} for layer in cache.compressed}


SENTENCES = Provider(
    name=SENTENCE_EXTRA,
    option=SENTENCE_EXTRA,
    check=_check_tokenizer,
    run=_sentences,
    description="sentence index per token, split after punctuation tokens (needs tokenizer=)",
)
"""The ``"sentence_ids"`` extras provider."""
