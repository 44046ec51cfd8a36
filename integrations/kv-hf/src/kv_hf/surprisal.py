"""Token surprisal from the prefill's own forward pass: the provider of the extra ``"surprisal"`` (read by SEKV's
``SurprisalScorer``; registered in :data:`kv_hf.providers.PROVIDERS` as :data:`PROVIDER`).

``H_t = −log p(x_t | x_<t)`` (SEKV, Eq. 1) needs the logits of every prompt position, but the prefill asks the model
for the last position only (``logits_to_keep=1``). Instead of a second forward pass, a forward hook on the decoder
(``model.get_decoder()``) keeps its final hidden states ``[B, T, d_model]`` during the prefill (chunks
concatenated), and the surprisal is computed from them and the output embedding in chunks of the vocabulary with
an online log-sum-exp: the ``[T, V]`` log-softmax is never materialised (extra cost: one ``T × V × d_model`` matmul,
streamed, and the ``[B, T, d_model]`` hidden states held until the end of the prefill): kvcore's
:func:`kvcore.surprisal.token_surprisal`, which defines the extra. Models with logit soft-capping are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kv_hf.providers import Provider, register
from kvcore.checks import check_int
from kvcore.surprisal import token_surprisal

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kv_hf.cache import CompressedCache


@dataclass(frozen=True)
class SurprisalConfig:
    """``vocab_chunk``: vocabulary entries per step of the streamed log-sum-exp (memory ``B·T·vocab_chunk``)."""

    vocab_chunk: int = 8192

    def __post_init__(self) -> None:
        check_int("vocab_chunk", self.vocab_chunk, low=1)


@dataclass
class HiddenCapture:
    """Final hidden states of the decoder, one tensor per prefill chunk."""

    chunks: list[torch.Tensor] = field(default_factory=list)

    def hidden(self) -> torch.Tensor:
        if not self.chunks:
            raise RuntimeError("no hidden states were captured during the prefill")
        return torch.cat(self.chunks, 1)


@contextmanager
def capture(model: PreTrainedModel) -> Iterator[HiddenCapture]:
    """Keep the decoder's last hidden states of every forward call inside the block."""
    found = HiddenCapture()

    def hook(_module, _args, output):
        h = output[0] if isinstance(output, tuple) else output.last_hidden_state
        found.chunks.append(h.detach())

    handle = model.get_decoder().register_forward_hook(hook)
    try:
        yield found
    finally:
        handle.remove()


def check_input(cache: CompressedCache, input_ids: torch.Tensor, attention_mask: Any, tokenizer: Any) -> None:
    """The surprisal is aligned with the collected tokens of a fresh cache."""
    if cache.get_seq_length() != 0:
        raise ValueError("the surprisal provider needs a fresh cache (the surprisal is computed over the prompt)")


def provide(
    model: PreTrainedModel,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    *,
    tokenizer: Any,
    context_start: int,
    config: SurprisalConfig | None,
    captured: HiddenCapture,
    attention_mask: torch.Tensor | None = None,
) -> dict[int, dict[str, Any]]:
    """``{layer_idx: {"surprisal": [B, T]}}`` for every layer of ``cache`` from the captured hidden states, by
    :func:`kvcore.surprisal.token_surprisal` (without autograd: the surprisal is an input to compression, never
    differentiated)."""
    config = SurprisalConfig() if config is None else config
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("the surprisal provider does not support logit soft-capping (final_logit_softcapping)")
    head = model.get_output_embeddings()
    hidden = captured.hidden()
    with torch.no_grad():
        s = token_surprisal(hidden, head.weight, input_ids, head.bias, attention_mask, config.vocab_chunk)
    return {layer.layer_idx: {"surprisal": s} for layer in cache.compressed}


PROVIDER = register(
    Provider(
        name="surprisal",
        option="surprisal",
        check=check_input,
        run=provide,
        description="token surprisal from the prefill's own hidden states, no extra forward pass (a fresh cache; "
        "configured with surprisal=kv_hf.surprisal.SurprisalConfig(...))",
        capture=capture,
    )
)
"""The ``"surprisal"`` extras provider (:mod:`kv_hf.providers`)."""
