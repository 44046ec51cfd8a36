"""KVzip's context-reconstruction pass on a transformers model: the provider of the extra ``"kvzip_scores"``
(read by ``kv_baselines.KVzipScorer``; registered in :data:`kv_hf.providers.PROVIDERS` as :data:`PROVIDER`).

Based on KVzip (arXiv:2505.23416), snu-mllab/KVzip ``model/wrapper.py`` (``self_task``, ``scoring``) and
``attention/score.py`` (``_get_score``); kvpress ``kvzip_press.py``. After the context is
prefilled (kept raw), the model is asked to repeat it: chunk ``i`` of ``chunk_size`` context tokens is fed as
``prompt_i + suffix + chunk_i`` where ``prompt_0 = "\\n\\nRepeat the previous context exactly."`` and later prompts
are ``"\\n\\nRepeat the part of the previous context exactly, starting with"`` followed by the last
``prev_tokens`` (8) tokens of the previous chunk. The reconstruction tokens attend to the whole cache as usual
(and are not kept); for scoring, every query of the pass attends (softmax over ``[sink | chunk_i | repeat
tokens (causal)]``, as in the original) and each chunk key's score is the max over the GQA group and the queries.
The sink is the prefix before the context (KVzip's system prompt), which is always kept.

Differences from the original: the softmax is computed in float32 (the original uses the model dtype), and the
queries are processed in blocks of ``query_block`` to bound memory. Batch size 1 only, like the KVzip and Fast KVzip
reference code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kv_hf.providers import Provider, register

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kv_hf.cache import CompressedCache
    from kv_hf.layer import CompressedLayer


@dataclass(frozen=True)
class KVzipConfig:
    """Parameters of the reconstruction pass (defaults from snu-mllab/KVzip ``self_task``).

    Parameters
    ----------
    chunk_size : int
        Context tokens reconstructed per forward pass (2000 in the original, 2048 in kvpress).
    prev_tokens : int
        Tokens of the previous chunk quoted in the prompt of the next one (8).
    first_prompt, later_prompt : str
        Reconstruction prompts.
    suffix : str
        Text between the prompt and the repeated chunk (the chat template's assistant header in the original;
        kvpress uses ``"\\n"`` for models without a chat template, as here — plain completion).
    query_block : int
        Reconstruction queries scored at once (memory bound, no effect on the result).
    """

    chunk_size: int = 2000
    prev_tokens: int = 8
    first_prompt: str = "\n\nRepeat the previous context exactly."
    later_prompt: str = "\n\nRepeat the part of the previous context exactly, starting with"
    suffix: str = "\n"
    query_block: int = 512

    def __post_init__(self) -> None:
        for name in ("chunk_size", "query_block"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prev_tokens < 0:
            raise ValueError(f"prev_tokens must be >= 0, got {self.prev_tokens}")

    def requests(
        self, context_ids: torch.Tensor, encode: Callable[[str], Sequence[int]]
    ) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, end, input_ids)`` per chunk: context offsets ``[start, end)`` and the reconstruction input."""
        device = context_ids.device

        def ids(text: str) -> torch.Tensor:
            return torch.tensor([list(encode(text))], dtype=torch.long, device=device).view(1, -1)

        first, later, suffix = ids(self.first_prompt), ids(self.later_prompt), ids(self.suffix)
        out = []
        T = context_ids.shape[1]
        for start in range(0, T, self.chunk_size):
            end = min(start + self.chunk_size, T)
            chunk = context_ids[:, start:end]
            if start == 0:
                prompt = first
            else:
                prompt = torch.cat([later, context_ids[:, max(start - self.prev_tokens, 0) : start]], 1)
            out.append((start, end, torch.cat([prompt, suffix, chunk], 1)))
        return out


class _Collector:
    """Observer of the scratch passes: max-over-group-and-queries softmax attention on the current chunk."""

    def __init__(self, cache: CompressedCache, sink_end: int, block: int) -> None:
        self.sink_end = sink_end
        self.block = block
        self.start = self.end = 0
        self.scores: dict[int, torch.Tensor] = {}
        for layer in cache.compressed:
            p = layer.pending
            if p is None or layer.held():
                raise ValueError(
                    f"layer {layer.layer_idx}: KVzip scoring needs the context collected raw and nothing stored "
                    "(use kv_hf.prefill on a fresh cache)"
                )
            self.scores[layer.layer_idx] = torch.zeros(p.keys.shape[:3], dtype=torch.float32, device=p.keys.device)

    def __call__(self, layer: CompressedLayer, query: torch.Tensor, new_keys: torch.Tensor, scaling: float) -> None:
        p = layer.pending
        pos, valid = p.positions[0], p.valid[0]
        sink = valid & (pos < self.sink_end)
        chunk = valid & (pos >= self.start) & (pos < self.end)
        ns, nc = int(sink.sum()), int(chunk.sum())
        if nc == 0:
            return
        keys = torch.cat([p.keys[:, :, sink], p.keys[:, :, chunk], new_keys], 2).float()  # [1, H, n, D]
        _, H, _n, D = keys.shape
        Hq, Q = query.shape[1], query.shape[2]
        q = query.float().reshape(1, H, Hq // H, Q, D)
        kt = keys[:, :, None].transpose(-1, -2)  # [1, H, 1, D, n]
        best = torch.zeros(1, H, nc, dtype=torch.float32, device=keys.device)
        for q0 in range(0, Q, self.block):
            qb = q[:, :, :, q0 : q0 + self.block]
            logits = torch.matmul(qb, kt) * scaling  # [1, H, g, b, n]
            qi = torch.arange(q0, q0 + qb.shape[3], device=keys.device)
            future = torch.arange(Q, device=keys.device)[None, :] > qi[:, None]  # repeat key j after query i
            logits[..., ns + nc :] = logits[..., ns + nc :].masked_fill(future, float("-inf"))
            attn = torch.softmax(logits, dim=-1)[..., ns : ns + nc]
            best = torch.maximum(best, attn.amax(dim=(2, 3)))
        scores = self.scores[layer.layer_idx]
        idx = chunk.nonzero().squeeze(-1)
        scores[:, :, idx] = torch.maximum(scores[:, :, idx], best)


@torch.no_grad()
def kvzip_scores(
    model: PreTrainedModel,
    cache: CompressedCache,
    context_ids: torch.Tensor,
    encode: Callable[[str], Sequence[int]],
    *,
    context_start: int = 0,
    config: KVzipConfig | None = None,
) -> dict[int, dict[str, Any]]:
    """Run the reconstruction pass over a cache that holds ``prefix + context`` raw; return per-layer extras.

    Parameters
    ----------
    model, cache
        The model and a :class:`~kv_hf.CompressedCache` whose layers collected the prefill (not compressed yet).
    context_ids : Tensor
        ``[1, Tc]`` the context tokens (those at positions ``context_start ... context_start + Tc - 1``).
    encode : callable
        ``text -> token ids`` without special tokens (``lambda s: tok.encode(s, add_special_tokens=False)``).
    context_start : int
        True position of the first context token; earlier tokens are the sink (score 1, always kept).

    Returns
    -------
    dict
        ``{layer_idx: {"kvzip_scores": [1, Hkv, T]}}`` aligned with the collected tokens.
    """
    config = KVzipConfig() if config is None else config
    if context_ids.ndim != 2 or context_ids.shape[0] != 1:
        raise ValueError(
            f"KVzip reconstruction runs on batch size 1: context_ids must be [1, T], got {tuple(context_ids.shape)}"
        )
    collector = _Collector(cache, context_start, config.query_block)
    with cache.scratch(collector):
        for start, end, ids in config.requests(context_ids, encode):
            collector.start, collector.end = context_start + start, context_start + end
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = {}
    for layer in cache.compressed:
        s = collector.scores[layer.layer_idx]
        p = layer.pending
        prefix = p.valid & (p.positions < context_start)
        out[layer.layer_idx] = {"kvzip_scores": s.masked_fill(prefix[:, None, :], 1.0)}
    return out


def check_input(
    cache: CompressedCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, tokenizer: Any
) -> None:
    """Refuse inputs the reconstruction pass cannot score (before the prefill runs)."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"KVzip's reconstruction pass supports batch size 1, got {input_ids.shape[0]}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("KVzip's reconstruction pass does not support padding")
    if cache.get_seq_length() != 0:
        raise ValueError("KVzip scoring needs a fresh cache (the context is reconstructed from position 0)")
    if tokenizer is None or not hasattr(tokenizer, "encode"):
        raise ValueError(
            "the KVzip scorer needs tokenizer= (an object with encode(text, add_special_tokens=False)) "
            "for the reconstruction prompts"
        )


def provide(
    model: PreTrainedModel,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    *,
    tokenizer: Any,
    context_start: int,
    config: KVzipConfig | None,
) -> dict[int, dict[str, Any]]:
    """The provider entry point: :func:`kvzip_scores` over ``input_ids[:, context_start:]``."""
    if config is not None and not isinstance(config, KVzipConfig):
        raise TypeError(f"kvzip must be a kv_hf.KVzipConfig, got {type(config).__name__}")

    def encode(text: str) -> Sequence[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return kvzip_scores(model, cache, input_ids[:, context_start:], encode, context_start=context_start, config=config)


PROVIDER = register(
    Provider(
        name="kvzip_scores",
        option="kvzip",
        check=check_input,
        run=provide,
        description="KVzip's context-reconstruction pass (batch size 1, no padding, a fresh cache, tokenizer=...; "
        "configured with kvzip=kv_hf.KVzipConfig(...))",
    )
)
"""The ``"kvzip_scores"`` extras provider (:mod:`kv_hf.providers`)."""
