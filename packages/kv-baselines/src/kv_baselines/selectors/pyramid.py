"""PyramidKV's layer budgets: more entries in lower layers, fewer in higher ones (Cai et al. 2024, "PyramidKV: Dynamic
KV Cache Compression based on Pyramidal Information Funneling", arXiv:2406.02069, §3; kvpress ``PyramidKVPress``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcore import Budget, Plan, Scores, Selector, TopKSelector
from kvcore.checks import check_number
from kvcore.plan import EVICT, FULL


def layer_counts(kept: int, n: int, protected: int, layers: int, beta: float) -> list[int]:
    """Entries each of ``layers`` layers keeps per head, an arithmetic sequence from the first layer down.

    kvpress ``PyramidKVPress.get_layer_budget`` (the KVCache-Factory formula): with ``k̄ = kept`` the mean per layer,
    the last layer keeps ``k̄ / beta`` and the first ``2k̄ - k̄ / beta``; when the first would exceed
    ``n - protected`` it keeps that and the last keeps the rest of ``2k̄``. Where the sequence does not fit
    (``n >= first >= last >= protected`` fails) every layer keeps ``k̄``, kvpress's SnapKV fallback. kvpress rounds
    each layer's count; here the counts are floored and the remainder goes to the layers with the largest fractions
    (ties: lower layer), so that they sum to exactly ``layers * kept``.

    Parameters
    ----------
    kept : int
        Mean entries per head per layer (the budget's ``kept(n)``).
    n : int
        Real tokens of the row.
    protected : int
        Entries every layer must keep (kvpress: the observation window ``window_size``).
    layers : int
        Number of layers selected together.
    beta : float
        Steepness (>= 1; 20 in kvpress): the last layer keeps ``1 / beta`` of the mean.
    """
    if layers == 1:
        return [kept]
    low = kept / beta
    high = 2 * kept - low
    if high >= n - protected:
        high = n - protected
        low = 2 * kept - high
    if not (n >= high >= low >= protected):
        return [kept] * layers
    step = (high - low) / (layers - 1)
    real = [high - i * step for i in range(layers)]
    counts = [math.floor(c + 1e-9) for c in real]
    left = layers * kept - sum(counts)
    order = sorted(range(layers), key=lambda i: (-(real[i] - counts[i]), i))
    for i in order[: max(0, left)]:
        counts[i] += 1
    return counts


@dataclass(frozen=True)
class PyramidSelector(Selector):
    """Top-k per head with a per-layer count that shrinks linearly with depth (PyramidKV §3).

    Under a ``"global"`` budget the selector receives every layer's scores at once (``[L, B, H, T]``, layer order),
    which is how it knows each layer's index and the number of layers: layer ``l`` of a row keeps
    :func:`layer_counts` ``[l]`` entries per head, chosen by top-k within the head (``kvcore.TopKSelector``), and
    all layers together keep ``L * H * budget.kept(n)`` per row, the budget of a uniform per-layer method. The
    protected entries of a row (the observation window) play kvpress's ``window_size`` in the fit test.
    Other budgets (``"head"``, ``"layer"``, or one layer's ``[B, H, T]`` scores) select as ``TopKSelector``.

    Parameters
    ----------
    beta : float
        Pyramid steepness, >= 1 (kvpress and the paper's code: 20): the top layer keeps ``1 / beta`` of the mean.
    """

    beta: float = 20.0
    plan_bits: ClassVar[frozenset[int]] = frozenset({EVICT, FULL})
    _topk: TopKSelector = field(default_factory=TopKSelector, init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_number("beta", self.beta, low=1.0))

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        if not isinstance(scores, Scores):
            raise TypeError(f"scores must be kvcore.Scores, got {type(scores).__name__}")
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a kvcore.Budget, got {type(budget).__name__}")
        if scores.keys.ndim == 3 or budget.granularity != "global" or budget.avg_bits is not None:
            return self._topk.select(scores, budget, protected, valid)
        L, B, _, T = scores.keys.shape
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=scores.keys.device)
        if protected is not None and not isinstance(protected, torch.Tensor):
            raise TypeError(f"protected must be a bool tensor, got {type(protected).__name__}")
        prot = None if protected is None else (protected if protected.ndim == 3 else protected[:, None, :])
        n_valid = valid.sum(-1).tolist()
        n_prot = [0] * B if prot is None else (prot & valid[:, None, :]).sum(-1).amax(-1).tolist()
        head = Budget(ratio=budget.ratio, tokens=budget.tokens, granularity="head")
        keys, values = [], []
        for b in range(B):
            kept = budget.kept(int(n_valid[b]))
            counts = layer_counts(kept, int(n_valid[b]), int(n_prot[b]), L, self.beta)
            row = slice(b, b + 1)
            layer_plans = []
            for lay, k in enumerate(counts):
                part = Scores(scores.keys[lay, row], None if scores.values is None else scores.values[lay, row])
                if k == 0 and kept > 0:  # a top layer whose share rounds to nothing keeps nothing
                    layer_plans.append(Plan.from_keep(torch.zeros_like(part.keys, dtype=torch.bool)))
                    continue
                own = head if k == kept else Budget(tokens=k, granularity="head")
                layer_plans.append(
                    self._topk.select(part, own, None if protected is None else protected[row], valid[row])
                )
            keys.append(torch.stack([p.key_bits for p in layer_plans]))
            values.append(torch.stack([p.bits_for_values for p in layer_plans]))
        key_bits = torch.cat(keys, 1)
        value_bits = None if scores.values is None else torch.cat(values, 1)
        return Plan(key_bits, value_bits)
