"""Hyper-parameters of HEX (paper §3.2-§3.5, §4.1-§4.2, Table 4).

The defaults are the paper's main configuration: 3-bit KCVT codes, expander density ρ = 3.125 % (§4.2), heavy
hitters 2 % and a recent window of 8 tokens (§4.2), streaming blocks of 96 tokens in append mode (§4.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any

from kvcore.checks import check_int, check_number

__all__ = ["BITS", "MASK_KINDS", "MODES", "SCOPES", "HEXConfig"]

BITS = (2, 3, 4, 8)
"""KCVT code widths HEX accepts (3 and 4 are the paper's; 2 and 8 for ablations)."""
MODES = ("append", "full")
"""Streaming modes (§4.1): compress each new block only, or re-compress the whole cache at each block end."""
SCOPES = ("layer", "head")
"""Channel axis of the expander mask / value groups: all ``H_kv·d_h`` channels of a layer, or one head's ``d_h``."""
MASK_KINDS = ("expander", "random", "none")
"""Element-level full-precision mask: the Ramanujan expander (HEX), a random unstructured mask of the same
density (the control of §3.2's structural claim), or none (KCVT / H2O-only ablations)."""


def _choice(name: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


@dataclass(frozen=True)
class HEXConfig:
    """Validated HEX hyper-parameters.

    Parameters
    ----------
    bits : int, default 3
        KCVT width of every quantized key and value element, in {2, 3, 4, 8} (HEX-3 / HEX-4, §4.2).
    rho : float, default 0.03125
        Expander density ρ: fraction of (token × channel) elements kept in full precision by the static mask,
        in the open interval (0, 1) (§4.2; 0.046875 for LongBench and the 4-bit ablation, Table 4).
    heavy_ratio : float, default 0.02
        Fraction ρ_hh of each compressed segment's tokens kept whole in full precision as heavy hitters (§3.3,
        §4.2), in [0, 1). The count is ``int(heavy_ratio * n)`` (truncation, as H2O and GEAR).
    recent : int, default 8
        ``r``: the last ``r`` tokens of each compressed segment are kept whole in full precision (§3.3, §4.2).
    block_size : int, default 96
        ``n_b``: streaming block (§4.1). A prefill of length ``L`` compresses its first ``⌊L/n_b⌋·n_b`` tokens
        as one segment; the rest waits in an fp16 residual that decoding fills to ``n_b``.
    mode : {"append", "full"}, default "append"
        ``"append"`` compresses each new full block only (earlier blocks untouched); ``"full"`` re-compresses the
        whole cache, from its held representation, at each block end (§4.1, Table 3).
    mask_scope : {"layer", "head"}, default "layer"
        Channels of the expander mask: all ``H_kv·d_h`` channels of the layer (the paper's native ``(n, d)``
        layout, §3.1) or one head's ``d_h`` (one mask shared by every head).
    value_scope : {"layer", "head"}, default "layer"
        Value group: all ``H_kv·d_h`` channels of a token, crossing KV heads as GEAR's KCVT does, or one head.
    mask_kind : {"expander", "random", "none"}, default "expander"
        Element-level full-precision mask (see :data:`MASK_KINDS`).
    masked_stats : bool, default True
        KCVT statistics over the entries that are not kept in full precision only (the spec's faithful reading of
        "the remaining entries are quantized", §3.5); False quantizes every entry, then overwrites masked ones.
    seed : int or None, default None
        Mask seed; ``None`` derives a fixed one from ``(n, d, ρ)`` (the paper gives none, §3.2).

    Raises
    ------
    TypeError, ValueError
        A field of the wrong type or outside its range; the message names the field and what is allowed.
    """

    bits: int = 3
    rho: float = 0.03125
    heavy_ratio: float = 0.02
    recent: int = 8
    block_size: int = 96
    mode: str = "append"
    mask_scope: str = "layer"
    value_scope: str = "layer"
    mask_kind: str = "expander"
    masked_stats: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, Integral):
            raise TypeError(f"bits must be an int, got {type(self.bits).__name__}")
        _choice("bits", int(self.bits), BITS)
        object.__setattr__(self, "bits", int(self.bits))
        rho = check_number("rho", self.rho)
        if not 0.0 < rho < 1.0:
            raise ValueError(f"rho must lie in the open interval (0, 1), got {rho}")
        object.__setattr__(self, "rho", rho)
        hh = check_number("heavy_ratio", self.heavy_ratio)
        if not 0.0 <= hh < 1.0:
            raise ValueError(f"heavy_ratio must lie in [0, 1), got {hh}")
        object.__setattr__(self, "heavy_ratio", hh)
        object.__setattr__(self, "recent", check_int("recent", self.recent, low=0))
        object.__setattr__(self, "block_size", check_int("block_size", self.block_size, low=1))
        _choice("mode", self.mode, MODES)
        _choice("mask_scope", self.mask_scope, SCOPES)
        _choice("value_scope", self.value_scope, SCOPES)
        _choice("mask_kind", self.mask_kind, MASK_KINDS)
        if not isinstance(self.masked_stats, bool):
            raise TypeError(f"masked_stats must be a bool, got {type(self.masked_stats).__name__}")
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int("seed", self.seed, low=0))

    def heavy_count(self, n: int) -> int:
        """Heavy hitters of an ``n``-token segment: ``int(heavy_ratio * n)`` (spec A4, H2O/GEAR truncation)."""
        return int(self.heavy_ratio * n)
