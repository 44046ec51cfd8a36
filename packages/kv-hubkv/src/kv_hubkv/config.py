"""Hyper-parameters of the HubKV refinement (paper §3.3, §4.1 and Appendix A).

The defaults are the paper's: "HubKV uses a 1D local max-pooling kernel of size 5, a non-hub
discount factor γ = 0.5, a bounded head-wise selectivity exponent τ = 0.5, clipping range
[0.8, 1.2], and compression-ratio gate exponent p = 2" (Appendix A; §4.1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from numbers import Integral
from typing import Any

from kvcore.checks import check_number

__all__ = ["HubKVConfig"]


@dataclass(frozen=True)
class HubKVConfig:
    """Validated HubKV hyper-parameters.

    Parameters
    ----------
    kernel_size : int, default 5
        Size ``2k + 1`` of the local window ``W_i = [i - k, i + k]`` used for hub detection
        (Eq. 6). Must be odd and ``>= 1`` (``1`` makes every unprotected token a hub).
    gamma : float, default 0.5
        Non-hub discount ``γ`` of Eq. 7. Must lie in the open interval ``(0, 1)``.
    tau : float, default 0.5
        Head-selectivity exponent ``τ`` of Eq. 9. Must be ``>= 0`` (``0`` disables calibration
        up to clipping).
    beta_min, beta_max : float, default 0.8, 1.2
        Clipping range of the head weight ``β`` (Eq. 9). Must satisfy ``0 < beta_min <= beta_max``.
    p : float, default 2.0
        Gate exponent of ``λ = r^p`` (Eq. 10). Must be ``> 0``.
    eps : float, default 1e-6
        ``ε`` in the coefficient of variation ``c = σ / (μ + ε)`` (Eq. 8). Must be ``> 0``.

    Raises
    ------
    TypeError
        If a field has the wrong type.
    ValueError
        If a field is outside its allowed range; the message names the field and the range.

    Notes
    -----
    See HubKV paper §3.3 (Eqs. 6–10), §4.1 and Appendix A for the defaults.
    """

    kernel_size: int = 5
    gamma: float = 0.5
    tau: float = 0.5
    beta_min: float = 0.8
    beta_max: float = 1.2
    p: float = 2.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        ks = self.kernel_size
        if isinstance(ks, bool) or not isinstance(ks, Integral):
            raise TypeError(f"kernel_size must be an int, got {type(ks).__name__}")
        if ks < 1 or ks % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {ks}")
        object.__setattr__(self, "kernel_size", int(ks))
        gamma = check_number("gamma", self.gamma)
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must lie in the open interval (0, 1), got {gamma}")
        tau = check_number("tau", self.tau)
        if tau < 0.0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        bmin = check_number("beta_min", self.beta_min)
        bmax = check_number("beta_max", self.beta_max)
        if bmin <= 0.0:
            raise ValueError(f"beta_min must be > 0, got {bmin}")
        if bmin > bmax:
            raise ValueError(f"beta_min must be <= beta_max, got beta_min={bmin} > beta_max={bmax}")
        p = check_number("p", self.p)
        if p <= 0.0:
            raise ValueError(f"p (gate exponent) must be > 0, got {p}")
        eps = check_number("eps", self.eps)
        if eps <= 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        for name, v in (("gamma", gamma), ("tau", tau), ("beta_min", bmin), ("beta_max", bmax), ("p", p), ("eps", eps)):
            object.__setattr__(self, name, v)

    @property
    def half_window(self) -> int:
        """``k = kernel_size // 2``, the half-width of the hub window ``[i - k, i + k]``."""
        return self.kernel_size // 2

    def gate(self, ratio: float) -> float:
        """Ratio gate ``λ = r^p`` of Eq. 10 (``ratio`` validated by the caller)."""
        return float(ratio) ** self.p

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments for :func:`kv_hubkv.refine`."""
        return asdict(self)
