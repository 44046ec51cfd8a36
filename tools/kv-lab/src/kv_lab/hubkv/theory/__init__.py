"""Analysis helpers for the theory of HubKV (paper §3.1–3.2 and Appendix J).

Not used on the inference path; they exist so the paper's statements can be checked on real or
synthetic scores (and are, in kv-lab's ``tests/test_hubkv_theory.py``).

* :mod:`.coverage` — the score-weighted local coverage objective ``F_sub`` (Eqs. 4–5, Def. 1),
  its marginal gains and the overlap ratio ``ρ`` of Prop. 2.
* :mod:`.oracle` — the sequential greedy oracle (Nemhauser et al.; §3.1) and brute force.
* :mod:`.bounds` — the bounded ratio-gated perturbation of Prop. 3 (Eqs. 16–17).
"""

from .bounds import perturbation_bounds, ranking_stability_threshold
from .coverage import CoverageObjective, gaussian_kernel, window_kernel
from .oracle import brute_force_select, greedy_select

__all__ = [
    "CoverageObjective",
    "brute_force_select",
    "gaussian_kernel",
    "greedy_select",
    "perturbation_bounds",
    "ranking_stability_threshold",
    "window_kernel",
]
