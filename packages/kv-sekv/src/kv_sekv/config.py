"""Hyper-parameters of SEKV (paper §3, §4.1, Appendix A and Table 7).

The defaults are the paper's: boundary threshold α = 1.0, minimum span length L_min = 16, maximum rank
R_max = 32, routing dimension d′ = 32, local window w = 512, gate threshold τ initialised at 0.05, loss weights
λ1 = 1.0, λ2 = 0.5, λ3 = 0.1, β = 0.1, positive-class weight w+ = 10, zoom coverage ρ = 0.9 and an accelerator
budget of 10 % of the full KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.checks import check_int, check_number

__all__ = ["DEFAULT_MAX_SPAN", "SEKVConfig"]

DEFAULT_MAX_SPAN = 64
"""Longest span by default (our addition, see :class:`SEKVConfig`): 4 · L_min, above the 16–48 tokens of the paper's
α = 1 on SmolLM2-135M and within a layer's zoom reserve at 10 % of 1k tokens (3 KV heads · ~25 tokens)."""


@dataclass(frozen=True)
class SEKVConfig:
    """Validated SEKV hyper-parameters.

    Parameters
    ----------
    alpha : float, default 1.0
        Boundary threshold: token ``t`` is an anchor when ``H_t > μ + α·σ`` (§3.1). Must be > 0.
    min_span : int, default 16
        ``L_min``: spans shorter than this stay at full resolution on the accelerator (§3.2). >= 1.
    max_rank : int, default 32
        ``R_max``: rank of the truncated SVD of a span, ``R = min(|S|, d_h, R_max)`` (Eq. 6). >= 1.
    proj_dim : int, default 32
        ``d′``: dimension of the routing projection ``W ∈ R^{d′×d_h}`` (Eq. 3–4). >= 1.
    window : int, default 512
        Local window ``w`` kept at full resolution (Eq. 17, Table 7). >= 0.
    tau_init : float, default 0.05
        Initial zoom threshold τ (§4.1). In [0, 1).
    gate_eps : float, default 0.05
        Components with a gate ``m < gate_eps`` are dropped at deployment (§3.2; the value is not given in the
        paper, this is our choice). In [0, 1).
    budget : float, default 0.1
        Accelerator budget as a fraction of the full KV cache (§4.1). In (0, 1].
    window_share : float, default 0.25
        Only with ``strict=False`` (our choice, the paper gives none): the window is shrunk to at most this share of
        the budget, since w = 512 alone exceeds 10 % of a 4K context. In (0, 1].
    zoom_share : float, default 0.25
        Only with ``strict=False`` (our choice): the share of the budget kept free for the spans reconstructed at a
        decoding step; α is raised until the persistent part fits the rest. In [0, 1).
    lambda_zoom, lambda_recon, lambda_budget : float, default 1.0, 0.5, 0.1
        ``λ1, λ2, λ3`` of the training loss (Eq. 10). >= 0.
    beta : float, default 0.1
        Weight of the gate mass in the budget loss (Eq. 15). >= 0.
    pos_weight : float, default 10.0
        ``w+`` of the weighted zoom BCE (Eq. 13). > 0.
    rho : float, default 0.9
        Teacher-mass coverage defining the zoom targets ``C_ρ`` (Eq. 12). In (0, 1].
    max_span : int, "auto" or None, default 64
        Our addition (the paper has no such limit): spans longer than this are cut into near-equal consecutive
        pieces (each at least ``max_span / 2`` long), so that spans stay in the size range the paper's α gives and a
        span can be reconstructed within the share of the budget kept for zoom-in. With ``strict=False`` it is
        doubled only when no α fits the budget with it. ``None``: the paper's maximal runs between anchors.
        ``"auto"``: the zoom share of the budget (``⌊zoom_share · budget tokens⌋``, at least ``min_span``), doubled
        until the persistent part fits. An int must be >= ``min_span`` (left at the default with ``min_span > 64``,
        it becomes ``4 · min_span``).
        Why: with the budget rule raising α, the runs between anchors get far longer than what the zoom share can
        hold (~300–400 tokens at 1k–4k on SmolLM2-135M), and the cap then never lets a span be expanded; the paper's
        α = 1 gives spans of 16–48 tokens on that model (docs/methods/sekv.md).

    Raises
    ------
    TypeError
        A field of the wrong type.
    ValueError
        A field outside its range; the message names the field and the range.
    """

    alpha: float = 1.0
    min_span: int = 16
    max_rank: int = 32
    proj_dim: int = 32
    window: int = 512
    tau_init: float = 0.05
    gate_eps: float = 0.05
    budget: float = 0.1
    window_share: float = 0.25
    zoom_share: float = 0.25
    lambda_zoom: float = 1.0
    lambda_recon: float = 0.5
    lambda_budget: float = 0.1
    beta: float = 0.1
    pos_weight: float = 10.0
    rho: float = 0.9
    max_span: int | str | None = DEFAULT_MAX_SPAN

    def __post_init__(self) -> None:
        for name, low in (("min_span", 1), ("max_rank", 1), ("proj_dim", 1), ("window", 0)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), low=low))
        if self.max_span == DEFAULT_MAX_SPAN and self.min_span > DEFAULT_MAX_SPAN:
            object.__setattr__(self, "max_span", 4 * self.min_span)
        if self.max_span is not None and self.max_span != "auto":
            if isinstance(self.max_span, str):
                raise ValueError(f"max_span must be an int >= min_span, 'auto' or None, got {self.max_span!r}")
            object.__setattr__(self, "max_span", check_int("max_span", self.max_span, low=self.min_span))
        ranges = {
            "alpha": (0.0, None, False),
            "tau_init": (0.0, 1.0, True),
            "gate_eps": (0.0, 1.0, True),
            "budget": (0.0, 1.0, False),
            "window_share": (0.0, 1.0, False),
            "zoom_share": (0.0, 1.0, True),
            "lambda_zoom": (0.0, None, True),
            "lambda_recon": (0.0, None, True),
            "lambda_budget": (0.0, None, True),
            "beta": (0.0, None, True),
            "pos_weight": (0.0, None, False),
            "rho": (0.0, 1.0, False),
        }
        for name, (low, high, low_closed) in ranges.items():
            v = check_number(name, getattr(self, name))
            ok_low = v >= low if low_closed else v > low
            # upper bounds: budget, window_share and rho are closed at 1; tau_init and gate_eps are open
            ok_high = high is None or (v <= high if name in ("budget", "window_share", "rho") else v < high)
            if not (ok_low and ok_high):
                lo = "[" if low_closed else "("
                hi = (
                    "inf)"
                    if high is None
                    else (f"{high}]" if name in ("budget", "window_share", "rho") else f"{high})")
                )
                raise ValueError(f"{name} must lie in {lo}{low}, {hi}, got {v}")
            object.__setattr__(self, name, v)
