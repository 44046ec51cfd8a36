"""The block tier selector of HqeKV (§3.3, Alg. 2 l.9-18)."""

from __future__ import annotations

import torch

from kv_hqekv.shares import Shares, TierCounts, tier_counts
from kvcore import EVICT, FULL, Budget, Plan, Scores, Selector
from kvcore.checks import check_bool_mask, check_int

SHARINGS: tuple[str, ...] = ("layer", "head")

_TIERS = (FULL, 4, 2, 1, EVICT)


def _widths(runs: list[tuple[int, int]], limit: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[min(limit, total)]``: each ``(width, count)`` of ``runs`` repeated ``count`` times, in order, cut at
    ``limit``; written by slices on ``device`` (no list copied from the host, which would wait for the device)."""
    total = min(limit, sum(n for _, n in runs))
    out = torch.empty(total, dtype=torch.uint8, device=device)
    start = 0
    for width, n in runs:
        end = min(start + n, total)
        if end > start:
            out[start:end] = width
        start = end
    return out


class HqeKVSelector(Selector):
    """Ranks position-aligned blocks of ``block`` tokens by their mean score and fills fp16 → 4 → 2 → 1 bit → evict
    (Wang et al. 2025, "HqeKV", §3.3, Alg. 2).

    * Only the first ``⌊N/block⌋·block`` columns are planned; the ``N mod block`` tail is the fp16 residual (Alg. 2).
    * Counts per tier come from :func:`kv_hqekv.shares.tier_counts`: ``min(fp16_blocks, n)`` fp16 blocks, then
      ``round(n'·δ)`` per tier with the 1-bit count repairing the sum. Keys and values are ranked separately (value
      scores ``scores.values``, importance × range) with equal counts (Alg. 2 l.17-18).
    * ``sharing="layer"`` (the paper): one ranking per layer, from the score averaged over batch rows and KV heads
      (padding excluded); ``"head"``: one ranking per (batch row, KV head).
    * Ties go to the lower block index (stable sort; the authors' ``torch.sort`` is unstable). Blocks without a
      valid token take no count and are evicted; padding is always ``EVICT``.
    * Protected entries are kept in full precision: their blocks take the fp16 slots first, and more protected blocks
      than ``fp16_blocks`` is a ``ValueError``.
    * ``joint_evict``: keys choose the evicted blocks, values evict the same ones (the other tiers are still ranked
      separately); default False, so a key may be evicted while its value is kept and vice versa.

    Parameters
    ----------
    shares : Shares
        Shares of the 4-bit, 2-bit, 1-bit and evict tiers outside the fp16 blocks (Eq. 3; Table 9 presets).
    block : int
        ``G`` (paper: 32).
    fp16_blocks : int
        Most important blocks kept in fp16 (paper: 2).
    joint_evict : bool
        See above.
    sharing : {"layer", "head"}
        See above.
    decoding : bool
        Decode-time re-plan: counts from :meth:`decode_shares` (see :func:`kv_hqekv.decoding.requantize`).

    Notes
    -----
    A ``Budget`` with ``avg_bits`` must match the shares' Eq. 3 bits (``4δ1 + 2δ2 + δ3``, code bits outside the
    fp16 blocks and the residual, which are extra); ratio and token budgets other than the default are refused:
    this selector is budgeted by its shares. :meth:`counts` reports the blocks per tier and the achieved bits.
    """

    tiers: tuple[int, ...] = _TIERS  # with resolve_shares: kvcore.TierShares

    def __init__(
        self,
        shares: Shares,
        block: int = 32,
        fp16_blocks: int = 2,
        joint_evict: bool = False,
        sharing: str = "layer",
        decoding: bool = False,
    ) -> None:
        if not isinstance(shares, Shares):
            raise TypeError(f"shares must be kv_hqekv.Shares, got {type(shares).__name__}")
        check_int("block", block, low=1)
        check_int("fp16_blocks", fp16_blocks, low=0)
        if not isinstance(joint_evict, bool):
            raise TypeError(f"joint_evict must be a bool, got {type(joint_evict).__name__}")
        if sharing not in SHARINGS:
            raise ValueError(f"sharing must be one of {SHARINGS}, got {sharing!r}")
        self.shares, self.block, self.fp16_blocks = shares, block, fp16_blocks
        if not isinstance(decoding, bool):
            raise TypeError(f"decoding must be a bool, got {type(decoding).__name__}")
        self.joint_evict, self.sharing, self.decoding = joint_evict, sharing, decoding

    def __repr__(self) -> str:
        return (
            f"HqeKVSelector(shares={self.shares}, block={self.block}, fp16_blocks={self.fp16_blocks}, "
            f"joint_evict={self.joint_evict}, sharing={self.sharing!r}, decoding={self.decoding})"
        )

    def for_decoding(self) -> HqeKVSelector:
        """This selector with the decode-time shares (:meth:`decode_shares`), for the re-plan every ``T`` tokens."""
        return HqeKVSelector(self.shares, self.block, self.fp16_blocks, self.joint_evict, self.sharing, decoding=True)

    def decode_shares(self, n_blocks: int) -> Shares:
        """Shares of a decode-time re-plan over ``n_blocks`` blocks (the authors' update after each flush):
        ``r_e = G·δ4 / (N_kept + G) = δ4 / n_blocks`` and the quantized shares rescaled to ``1 - r_e``. So only the
        new block's share of eviction is applied, which rounds to no eviction for ``δ4 < 0.5``."""
        q = self.shares.q4 + self.shares.q2 + self.shares.q1
        r_e = self.shares.evict / max(1, n_blocks)
        f = (1 - r_e) / q if q > 0 else 0.0
        return Shares(self.shares.q4 * f, self.shares.q2 * f, self.shares.q1 * f, r_e if q > 0 else 1.0)

    def counts(self, n_blocks: int) -> TierCounts:
        """Blocks per tier for ``n_blocks`` planned blocks (fp16, 4, 2, 1, evict) and the achieved bits."""
        shares = self.decode_shares(n_blocks) if self.decoding else self.shares
        return tier_counts(n_blocks, shares, self.fp16_blocks)

    def resolve_shares(self, budget: Budget) -> dict[int, float]:
        """The Eq. 3 shares δ of the 4-bit, 2-bit, 1-bit and evict tiers under ``budget``
        (:class:`kvcore.TierShares`).

        They apply to the blocks outside the ``fp16_blocks`` fp16 blocks and the ``N mod block`` residual, whose
        counts depend on the length, not on the budget (:meth:`counts` gives the blocks per tier of a length); a
        decode-time selector (``decoding``) counts by :meth:`decode_shares` instead. ``budget`` is checked as
        :meth:`select` checks it: a ratio or token budget, or an ``avg_bits`` other than the shares' Eq. 3 bits, is
        a ``ValueError``.
        """
        self._check_budget(budget)
        return {4: self.shares.q4, 2: self.shares.q2, 1: self.shares.q1, EVICT: self.shares.evict}

    def _check_budget(self, budget: Budget) -> None:
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a kvcore.Budget, got {type(budget).__name__}")
        if budget.tokens is not None or (budget.ratio or 0.0) != 0.0:
            raise ValueError(
                "HqeKVSelector is budgeted by its shares (Budget(avg_bits=...)); got a ratio/token budget "
                f"(ratio={budget.ratio}, tokens={budget.tokens})"
            )
        if budget.avg_bits is not None and not self.decoding:
            self.shares.check_bits(budget.avg_bits)

    # -- selection -----------------------------------------------------------------------------------------
    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        """A plan ``[B, Hkv, N]`` of fp16 / 4 / 2 / 1-bit / evict tiers (class doc)."""
        if not isinstance(scores, Scores):
            raise TypeError(f"scores must be kvcore.Scores, got {type(scores).__name__}")
        self._check_budget(budget)
        if scores.keys.ndim != 3:
            raise ValueError(f"HqeKVSelector plans one layer: scores must be [B, Hkv, N], got {scores.shape}")
        B, H, N = scores.shape
        device = scores.keys.device
        valid = torch.ones(B, N, dtype=torch.bool, device=device) if valid is None else valid
        valid = check_bool_mask("valid", valid, (B, N)).to(device)
        v3 = valid[:, None, :].expand(B, H, N)
        if protected is None:
            prot = torch.zeros(B, H, N, dtype=torch.bool, device=device)
        else:
            if not isinstance(protected, torch.Tensor) or protected.dtype != torch.bool:
                raise TypeError(f"protected must be a bool tensor, got {getattr(protected, 'dtype', type(protected))}")
            shape = (B, N) if protected.ndim == 2 else (B, H, N)
            protected = check_bool_mask("protected", protected, shape).to(device)
            prot = (protected[:, None, :] if protected.ndim == 2 else protected).expand(B, H, N) & v3
        G = self.block
        P = N // G * G
        key_bits = torch.where(v3, FULL, EVICT).to(torch.uint8)  # the residual tail (and padding)
        value_bits = key_bits.clone()
        if P:
            kb, kevict = self._plan(scores.keys, v3, prot, P, None)
            vb, _ = self._plan(scores.for_values, v3, prot, P, kevict if self.joint_evict else None)
            key_bits[..., :P], value_bits[..., :P] = kb, vb
        return Plan(key_bits, None if torch.equal(key_bits, value_bits) else value_bits)

    def _plan(
        self, s: torch.Tensor, valid: torch.Tensor, prot: torch.Tensor, P: int, evicted: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiers ``[B, H, P]`` of the planned columns from scores ``s``; and the evicted-block mask ``[R, nb]``.

        With ``evicted`` (joint eviction), those blocks are evicted and the other tiers fill the remaining blocks.
        """
        B, H, _ = s.shape
        G = self.block
        nb = P // G
        s, valid, prot = s[..., :P].float(), valid[..., :P], prot[..., :P]
        if self.sharing == "layer":  # one ranking per layer: mean over rows, heads and the block's valid tokens
            total = (s * valid).reshape(B * H, nb, G).sum(dim=(0, 2))[None]
            count = valid.reshape(B * H, nb, G).sum(dim=(0, 2))[None]
            pblk = prot.reshape(B * H, nb, G).any(-1).any(0)[None]
        else:
            total = (s * valid).reshape(B * H, nb, G).sum(-1)
            count = valid.reshape(B * H, nb, G).sum(-1)
            pblk = prot.reshape(B * H, nb, G).any(-1)
        metric = total / count.clamp_min(1)
        live = count > 0
        metric = torch.where(pblk, float("inf"), metric).masked_fill(~live, float("-inf"))
        tiers = torch.full(metric.shape, EVICT, dtype=torch.uint8, device=s.device)
        n_live, n_prot = torch.stack([live.sum(-1), (pblk & live).sum(-1)]).tolist()  # one host read
        for r in range(metric.shape[0]):
            c = self.counts(n_live[r])
            if n_prot[r] > c.fp16:
                raise ValueError(
                    f"{n_prot[r]} blocks hold protected entries but only {c.fp16} fp16 blocks are planned "
                    f"(fp16_blocks={self.fp16_blocks}); protect at most that many blocks"
                )
            order = torch.sort(metric[r], descending=True, stable=True).indices
            runs = [(FULL, c.fp16), (4, c.q4), (2, c.q2), (1, c.q1), (EVICT, c.evict)]
            if evicted is not None:  # values: evict the key-evicted blocks, rank the rest
                ev = evicted[r] & live[r]
                order = order[~ev[order]]
                runs = runs[:-1]  # the evicted blocks are the keys'; the rest take the other widths in order
            tiers[r, order[: sum(n for _, n in runs)]] = _widths(runs, order.shape[0], s.device)
        tiers = tiers.masked_fill(~live, EVICT)
        out = tiers.expand(B * H, nb) if self.sharing == "layer" else tiers
        bits = out.repeat_interleave(G, -1).reshape(B, H, P)
        bits = torch.where(valid, bits, EVICT).to(torch.uint8)
        bits = torch.where(prot, FULL, bits).to(torch.uint8)
        return bits, tiers == EVICT
