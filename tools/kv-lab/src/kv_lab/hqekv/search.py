"""The ratio search of HqeKV (§3.3, Alg. 1, App. A.3): TPE over the 1-bit and evict shares.

Free variables ``x3`` (1-bit share) and ``x4`` (evict share) are drawn by Optuna's TPE sampler from ``[0, 1]``; the
4- and 2-bit shares follow from Eq. 3 (:func:`kv_hqekv.shares.solve_eq3`, with the ``/2`` Alg. 1 drops); a trial
with ``δ1 < 0`` or ``δ2 < 0`` is infeasible and scores ``+inf``. The objective is
``L = L_c + α·x3 + β·x4`` (α = 2, β = 4), ``L_c`` a calibration loss of the compressed cache
(:func:`prefill_cross_entropy`). Optuna, tqdm and kv-hf are kv-lab's dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kv_hqekv.config import HqeKVConfig
from kv_hqekv.shares import Shares, feasible
from kvcore.checks import check_int, check_number


@dataclass(frozen=True)
class SearchResult:
    """Outcome of :func:`search_shares`.

    Attributes
    ----------
    shares : Shares
        Best feasible shares.
    loss : float
        Its objective ``L_c + α·x3 + β·x4``.
    calibration_loss : float
        Its ``L_c``.
    trials : list of dict
        Every trial: ``x3``, ``x4``, ``feasible``, ``calibration_loss``, ``loss``.
    settings : dict
        ``bits``, ``trials``, ``seed``, ``alpha``, ``beta`` and what the caller adds (model, calibration ...).
    """

    shares: Shares
    loss: float
    calibration_loss: float
    trials: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON-ready dict (the shares file ``kv-hqekv search`` writes)."""
        return {
            "shares": asdict(self.shares),
            "avg_bits": self.shares.avg_bits,
            "loss": self.loss,
            "calibration_loss": self.calibration_loss,
            "settings": self.settings,
            "trials": self.trials,
        }


def search_shares(
    calibration_loss: Callable[[Shares], float],
    bits: float,
    trials: int | None = None,
    seed: int = 0,
    config: HqeKVConfig | None = None,
    progress: bool = False,
) -> SearchResult:
    """Alg. 1: TPE over ``(x3, x4)``; returns the best feasible shares.

    Parameters
    ----------
    calibration_loss : callable
        ``L_c(shares) -> float`` (lower is better), e.g. a closure over :func:`prefill_cross_entropy`.
    bits : float
        ``B_avg`` of Eq. 3, in ``(0, 4]``.
    trials : int, optional
        Number of TPE trials (default ``config.trials``, 200 in the paper).
    seed : int
        Seed of the TPE sampler (the paper's runs are unseeded); the same seed and loss give the same trials.
    config : HqeKVConfig, optional
        ``alpha``, ``beta`` and ``trials``.
    progress : bool
        Show a tqdm progress bar.

    Raises
    ------
    ValueError
        No trial was feasible (raise ``trials``), or bad arguments.
    """
    try:
        import optuna
    except ImportError as e:  # pragma: no cover - the extra is installed in the workspace
        raise ImportError("the ratio search needs optuna: pip install kv-lab") from e
    if not callable(calibration_loss):
        raise TypeError(f"calibration_loss must be callable, got {type(calibration_loss).__name__}")
    cfg = HqeKVConfig() if config is None else config
    b = check_number("bits", bits, low=0.0, high=4.0)
    if b == 0:
        raise ValueError("bits must be > 0 (Eq. 3: B_avg > 0)")
    n = cfg.trials if trials is None else check_int("trials", trials, low=1)
    check_int("seed", seed)
    log: list[dict] = []

    def objective(trial) -> float:
        x3, x4 = trial.suggest_float("x3", 0.0, 1.0), trial.suggest_float("x4", 0.0, 1.0)
        shares = feasible(b, x3, x4) if x3 + x4 <= 1.0 else None
        row = {"x3": x3, "x4": x4, "feasible": shares is not None, "calibration_loss": None, "loss": math.inf}
        if shares is not None:
            lc = float(calibration_loss(shares))
            row["calibration_loss"], row["loss"] = lc, lc + cfg.alpha * x3 + cfg.beta * x4
        log.append(row)
        return row["loss"]

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=f"HqeKV search {b:g} bits")
    for _ in range(n):
        study.optimize(objective, n_trials=1)
        if bar is not None:
            best = min((r["loss"] for r in log), default=math.inf)
            bar.set_postfix(best=f"{best:.4f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    feasible_rows = [r for r in log if r["feasible"]]
    if not feasible_rows:
        raise ValueError(f"no feasible trial in {n} TPE trials at bits={b}; raise trials")
    best = min(feasible_rows, key=lambda r: r["loss"])
    settings = {"bits": b, "trials": n, "seed": seed, "alpha": cfg.alpha, "beta": cfg.beta}
    return SearchResult(feasible(b, best["x3"], best["x4"]), best["loss"], best["calibration_loss"], log, settings)


def prefill_cross_entropy(
    model, context_ids, continuation_ids, compressor, reference_labels=None, code_compat: bool = False
) -> float:
    """``L_c``: cross-entropy of the compressed-cache model on ``continuation_ids`` against the full-cache model's
    argmax at the same positions (the spec's same-position hard labels; the authors' code shifts them by one).

    The context is prefilled exactly and compressed by ``compressor`` through the HF adapter (``kv_hf``, imported
    here; a dependency of kv-lab), then the continuation is teacher-forced over the compressed cache. The
    paper instead fake-quantizes K/V inside the prefill attention; this measures the cache the model will decode
    with.

    Parameters
    ----------
    model : transformers PreTrainedModel
    context_ids, continuation_ids : Tensor
        ``[1, N]`` and ``[1, M]`` token ids.
    compressor : kvcore.Compressor
    reference_labels : Tensor, optional
        ``[M]`` full-cache argmax labels (computed when omitted; pass them to reuse across trials).
    code_compat : bool
        Reproduce the authors' label shift (HF ``loss_function`` shifts labels, so position ``t`` is scored
        against the full cache's argmax at ``t + 1``). Their other search-time deviations (values fake-quantized at
        8 bits, evicted keys set to 0 instead of removed) are not reproduced.
    """
    import torch

    try:
        import kv_hf
    except ImportError as e:
        raise ImportError("prefill_cross_entropy needs the HF adapter: pip install kv-hf transformers") from e
    with torch.no_grad():
        if reference_labels is None:
            reference_labels = full_cache_labels(model, context_ids, continuation_ids)
        cache = kv_hf.compressed_cache(model, compressor)
        kv_hf.prefill(model, cache, context_ids)
        logits = model(continuation_ids, past_key_values=cache).logits[0].float()
        labels = reference_labels.to(logits.device)
        if code_compat:
            logits, labels = logits[:-1], labels[1:]
        return float(torch.nn.functional.cross_entropy(logits, labels))


def full_cache_labels(model, context_ids, continuation_ids):
    """The full-precision model's argmax over the continuation (``[M]``), the hard labels of ``L_c``."""
    import torch

    with torch.no_grad():
        ids = torch.cat([context_ids, continuation_ids], dim=1)
        return model(ids).logits[0, context_ids.shape[1] :].argmax(-1)
