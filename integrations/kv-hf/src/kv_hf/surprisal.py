"""Token surprisal from the prefill's own forward pass: the provider of the extra ``"surprisal"`` (read by SEKV's
``SurprisalScorer``; registered in :data:`kv_hf.providers.PROVIDERS`).

``H_t = −log p(x_t | x_<t)`` (SEKV, Eq. 1) needs the logits of every prompt position, but the prefill asks the model
for the last position only (``logits_to_keep=1``). Instead of a second forward pass, a forward hook on the decoder
(``model.get_decoder()``) keeps its final hidden states ``[B, T, d_model]`` during the prefill (chunks
concatenated), and the surprisal is computed from them and the output embedding in chunks of the vocabulary with
an online log-sum-exp: the ``[T, V]`` log-softmax is never materialised (extra cost: one ``T × V × d_model`` matmul,
streamed, and the ``[B, T, d_model]`` hidden states held until the end of the prefill). Models with logit
soft-capping are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kv_hf.cache import CompressedCache


@dataclass(frozen=True)
class SurprisalConfig:
    """``vocab_chunk``: vocabulary entries per step of the streamed log-sum-exp (memory ``B·T·vocab_chunk``)."""

    vocab_chunk: int = 8192

    def __post_init__(self) -> None:
        if isinstance(self.vocab_chunk, bool) or not isinstance(self.vocab_chunk, int) or self.vocab_chunk < 1:
            raise ValueError(f"vocab_chunk must be an int >= 1, got {self.vocab_chunk!r}")


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


def token_surprisal(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    vocab_chunk: int = 8192,
) -> torch.Tensor:
    """``[B, T]`` float32 surprisal (nats) from hidden states ``[B, T, d]`` and the LM head ``weight [V, d]``; the
    first real token of a row and padding are 0."""
    B, T, _ = hidden.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    if T < 2:
        return out
    h = hidden[:, :-1].float()
    target = input_ids[:, 1:].to(hidden.device).long()
    picked = (h * weight.float()[target]).sum(-1)
    if bias is not None:
        picked = picked + bias.float()[target]
    lse = torch.full((B, T - 1), float("-inf"), device=hidden.device)
    for a in range(0, weight.shape[0], vocab_chunk):
        logits = h @ weight[a : a + vocab_chunk].float().T
        if bias is not None:
            logits = logits + bias[a : a + vocab_chunk].float()
        lse = torch.logaddexp(lse, torch.logsumexp(logits, -1))
    out[:, 1:] = lse - picked
    if attention_mask is not None:
        mask = attention_mask.to(out.device).bool()
        prev = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=out.device), mask[:, :-1]], 1)
        out = torch.where(mask & prev, out, 0.0)
    return out.clamp_min(0.0)


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
    """``{layer_idx: {"surprisal": [B, T]}}`` for every layer of ``cache`` from the captured hidden states (computed
    without autograd: the surprisal is an input to compression, never differentiated)."""
    config = SurprisalConfig() if config is None else config
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("the surprisal provider does not support logit soft-capping (final_logit_softcapping)")
    head = model.get_output_embeddings()
    hidden = captured.hidden()
    with torch.no_grad():
        s = token_surprisal(hidden, head.weight, input_ids, head.bias, attention_mask, config.vocab_chunk)
    return {layer.layer_idx: {"surprisal": s} for layer in cache.layers}
