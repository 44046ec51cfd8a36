"""Expected Attention: the attention future queries are expected to pay each key (Devoto et al. 2025, "Expected
Attention: KV cache compression by estimating attention from future queries distribution", arXiv:2510.00636, §3;
kvpress ``ExpectedAttentionPress``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kv_baselines.scorers._rope import mean_rotation, unrotate
from kvcore import Scorer, Scores, ScoringContext
from kvcore.checks import check_int, check_number

ROPE_EXTRA = "rope_inv_freq"
"""``ctx.extras`` key of the layer's RoPE inverse frequencies (``[D_rot / 2]``, HF's ``rotate_half`` layout)."""


@dataclass(frozen=True)
class ExpectedAttentionScorer(Scorer):
    """Expected softmax attention of the next ``n_future_positions`` queries on every key, times the value norm.

    The prompt's queries are modelled as a Gaussian per query head (§3): their mean ``μ`` and covariance ``Σ``
    are taken over the pre-RoPE queries (the supplied post-RoPE queries rotated back by their own positions, so
    QK-norm models are covered), skipping the first ``n_sink`` tokens. The queries at the next
    ``n_future_positions`` positions are approximated by rotating that Gaussian by the mean RoPE rotation ``R̄`` of
    those positions (§3, kvpress's averaged rotation): ``μ̄ = R̄μ``, ``Σ̄ = R̄ΣR̄ᵀ``. The expected logit of a
    key ``k`` is the log of the Gaussian moment generating function, ``μ̄·k/√D + kᵀΣ̄k/(2D)`` (§3;
    kvpress divides the quadratic term by ``D``, as here), turned into attention by a softmax over the non-sink keys,
    averaged over the GQA group, and multiplied by ``‖v‖`` (``(a + epsilon)·‖v‖``, §3: the
    expected contribution to the residual stream). The first ``n_sink`` real
    tokens get the largest score of their row (kvpress keeps them).

    Parameters
    ----------
    n_future_positions : int
        Future positions the query distribution is rotated over (512 in kvpress).
    n_sink : int
        Leading real tokens left out of the statistics and of the softmax, and always scored highest (4 in kvpress).
    use_covariance : bool
        Add the covariance term ``kᵀΣ̄k/(2D)`` (kvpress default ``True``); ``False`` uses the mean only.
    use_vnorm : bool
        Multiply by the value norm (kvpress default ``True``).
    epsilon : float
        Added to the expected attention before the value-norm product (kvpress default 0).
    stats_window : int or None
        Prompt queries the statistics come from: ``None`` (default) = every prompt query, as kvpress (which projects
        every hidden state after the sinks); an int uses the last ``stats_window`` queries only (less memory in the
        adapter).

    Notes
    -----
    Reads ``ctx.queries``, ``ctx.values`` and ``ctx.extras["rope_inv_freq"]``: the layer's RoPE inverse frequencies
    ``[D_rot / 2]`` (``D_rot = D`` unless the rotary embedding is partial), which kv-hf supplies from the model's
    rotary embedding (provider ``"rope_inv_freq"``, shipped by kv-baselines). A RoPE attention scale (YaRN) needs no
    special case: it scales queries and keys alike, and the statistics are taken from the scaled queries.
    Departures from kvpress: the statistics come from the queries the model computed (kvpress projects hidden states
    with ``W_q`` and drops any bias), at KV-head granularity (the group mean of the softmaxes, as kvpress, without
    ``repeat_kv``), and the sink score is the row's maximum (kvpress: the batch maximum).
    """

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    stats_window: int | None = None
    needs_queries: ClassVar[bool] = True
    needs_values: ClassVar[bool] = True
    needs_extras: ClassVar[frozenset[str]] = frozenset({ROPE_EXTRA})

    def __post_init__(self) -> None:
        check_int("n_future_positions", self.n_future_positions, low=1)
        check_int("n_sink", self.n_sink, low=0)
        for flag in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {type(getattr(self, flag)).__name__}")
        check_number("epsilon", self.epsilon, low=0.0)
        check_int("stats_window", self.stats_window, low=1, optional="every prompt query")

    @property
    def query_window(self) -> int | None:
        """Trailing prompt queries the adapter must supply (``None`` = all of them)."""
        return self.stats_window

    def inv_freq(self, ctx: ScoringContext) -> torch.Tensor:
        """The checked ``extras["rope_inv_freq"]`` as float64 on the keys' device."""
        if ROPE_EXTRA not in ctx.extras:
            raise ValueError(
                f"ExpectedAttentionScorer needs ctx.extras[{ROPE_EXTRA!r}] (the layer's RoPE inverse frequencies); "
                "with transformers, kv_hf.prefill supplies it from the model's rotary embedding"
            )
        f = ctx.extras[ROPE_EXTRA]
        D = ctx.keys.shape[-1]
        if not isinstance(f, torch.Tensor) or f.ndim != 1 or not 1 <= f.shape[0] <= D // 2:
            got = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise ValueError(f"extras[{ROPE_EXTRA!r}] must be a 1-D tensor of 1 to D/2={D // 2} frequencies, got {got}")
        if not bool(torch.isfinite(f).all()):
            raise ValueError(f"extras[{ROPE_EXTRA!r}] must be finite")
        return f.to(device=ctx.keys.device, dtype=torch.float64)

    def statistics(self, ctx: ScoringContext, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``μ̄`` ``[B, Hq, D]`` and ``Σ̄`` ``[B, Hq, D, D]`` (or ``None``) of the future queries, float64."""
        q = ctx.queries
        W, D = q.shape[2], q.shape[3]
        W = min(W, ctx.seq_len)
        q = q[:, :, -W:]
        pos = ctx.positions[:, -W:].long()
        rank = ctx.valid.long().cumsum(-1)[:, -W:] - 1  # index among the real tokens
        used = (ctx.valid[:, -W:] & (rank >= self.n_sink)).double()  # [B, W]
        pre = unrotate(q.double(), pos, inv_freq)  # [B, Hq, W, D]
        n = used.sum(-1).clamp(min=1.0)[:, None, None]  # [B, 1, 1]
        mu = torch.einsum("bhwd,bw->bhd", pre, used) / n
        nxt = torch.where(ctx.valid, ctx.positions.long(), -1).amax(-1) + 1  # first future position per row
        R = mean_rotation(nxt, self.n_future_positions, inv_freq, D)  # [B, D, D]
        mu_bar = torch.einsum("bij,bhj->bhi", R, mu)
        if not self.use_covariance:
            return mu_bar, None
        centred = (pre - mu[:, :, None]) * used[:, None, :, None]
        cov = torch.einsum("bhwi,bhwj->bhij", centred, centred) / n[..., None]
        return mu_bar, torch.einsum("bij,bhjk,blk->bhil", R, cov, R)

    def score(self, ctx: ScoringContext) -> Scores:
        if ctx.queries is None:
            raise ValueError("ExpectedAttentionScorer needs ctx.queries ([B, Hq, W, D], the prompt's queries)")
        inv_freq = self.inv_freq(ctx)
        mu, cov = self.statistics(ctx, inv_freq)
        B, H, _, D = ctx.keys.shape
        G = mu.shape[1] // H
        k = ctx.keys.double()
        logits = torch.einsum("bhgd,bhtd->bhgt", mu.view(B, H, G, D), k) / math.sqrt(D)
        if cov is not None:
            quad = torch.einsum("bhti,bhgij,bhtj->bhgt", k, cov.view(B, H, G, D, D), k)
            logits = logits + quad / (2 * D)
        rank = ctx.valid.long().cumsum(-1) - 1
        sink = ctx.valid & (rank < self.n_sink)
        scored = ctx.valid & ~sink  # [B, T]
        logits = logits.masked_fill(~scored[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(2)  # [B, H, T], GQA mean after the softmax
        if self.use_vnorm:
            probs = (probs + self.epsilon) * torch.linalg.vector_norm(ctx.values.double(), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0).masked_fill(~scored[:, None, :], 0.0)
        top = probs.flatten(1).amax(-1)[:, None, None]  # the row's largest score, for the sinks
        out = torch.where(sink[:, None, :], top, probs).float()
        return Scores(torch.nan_to_num(out, nan=0.0, posinf=torch.finfo(torch.float32).max).contiguous())


__all__ = ["ROPE_EXTRA", "ExpectedAttentionScorer"]
