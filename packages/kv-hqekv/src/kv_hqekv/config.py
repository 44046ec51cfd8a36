"""``HqeKVConfig``: the hyper-parameters of HqeKV with the paper's defaults (App. A.6, §3.3, §4.5)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.checks import check_int, check_number

BIT_WIDTHS: tuple[int, ...] = (1, 2, 4, 8, 16)
"""Widths a tier may use: the normalized 1-bit tier, uniform 2/4/8-bit tiers and fp16 (§3.4)."""


@dataclass(frozen=True)
class HqeKVConfig:
    """Validated HqeKV hyper-parameters (Wang et al. 2025, "HqeKV", App. A.6 and §3.3).

    Parameters
    ----------
    block : int
        ``G``: tokens per block (the unit of tier assignment, position-aligned), tokens per key quantization
        group (per channel) and channels per value quantization group (per token). Paper: 32.
    period : int
        ``T``: re-quantization gap in decode tokens; the fp16 residual holds fewer than ``T`` tokens. Paper: 32.
        Must be a multiple of ``block`` (a flush quantizes whole blocks).
    window : int
        ``m``: number of most recent queries whose attention scores the tokens (Alg. 2). Paper: 20.
    alpha, beta : float
        Penalties on the 1-bit and evict shares in the ratio-search loss ``L = L_c + α·x3 + β·x4``
        (Alg. 1; §4.5 sweeps them). Paper: 2 and 4.
    fp16_blocks : int
        Most important blocks kept in full precision (§3.3: "retain the most important 2 chunks"). Paper: 2.
    trials : int
        TPE trials of the ratio search (§4.6). Paper: 200.
    times_range : bool
        Rank values by importance × token range of V (the joint metric, §3.2); False ranks V like K.
    normalize_importance : bool
        Divide each token's summed window attention by the number of window queries that see it (the authors'
        code); False is the paper's plain cumulative sum.
    joint_evict : bool
        Evict the same blocks for keys and values (chosen by the key metric). False (default) ranks K and V
        separately, so a block's key may be evicted while its value is kept and vice versa.
    one_bit : {"normalized", "uniform"}
        The 1-bit tier's quantizer: normalized (§3.4, the default) or uniform min-max (Table 6 "w/o II").
    """

    block: int = 32
    period: int = 32
    window: int = 20
    alpha: float = 2.0
    beta: float = 4.0
    fp16_blocks: int = 2
    trials: int = 200
    times_range: bool = True
    normalize_importance: bool = True
    joint_evict: bool = False
    one_bit: str = "normalized"

    def __post_init__(self) -> None:
        check_int("block", self.block, low=1)
        check_int("period", self.period, low=1)
        if self.period % self.block:
            raise ValueError(
                f"period ({self.period}) must be a multiple of block ({self.block}): flushes are whole blocks"
            )
        check_int("window", self.window, low=1)
        check_number("alpha", self.alpha, low=0.0)
        check_number("beta", self.beta, low=0.0)
        check_int("fp16_blocks", self.fp16_blocks, low=0)
        check_int("trials", self.trials, low=1)
        for name in ("times_range", "normalize_importance", "joint_evict"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.one_bit not in ("normalized", "uniform"):
            raise ValueError(f"one_bit must be 'normalized' or 'uniform', got {self.one_bit!r}")
