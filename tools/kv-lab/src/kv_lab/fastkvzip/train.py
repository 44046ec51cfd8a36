"""Training data and loop of the FastKVzip gate (Fast KVzip, Kim et al. 2026a, §3: gates trained with the LLM frozen
on its own KVzip reconstruction scores; authors' ``optim.py``: binary cross-entropy, SGD momentum 0.9, lr 0.2 with
warm-up and two decays, 1,000-token batches).

:func:`collect` runs the frozen model through ``kv_hf.prefill`` with KVzip's reconstruction pass and records, per
layer, exactly what the FastKVzip scorer will see (post-RoPE keys and values) with the KVzip scores as targets;
:func:`train` fits a :class:`kv_baselines.FastKVzipGate` on the training sequences and :func:`evaluate` reports the
held-out loss and how well the gate ranks like KVzip (top-k recall of KVzip's kept entries per layer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kv_baselines.scorers.fastkvzip import FastKVzipGate, gate_features
from kv_baselines.scorers.kvzip import KVZIP_EXTRA
from kvcore import Budget, Compressor, DenseStore, Scorer, Scores, ScoringContext, TopKSelector

__all__ = ["collect", "evaluate", "train"]


@dataclass(frozen=True, eq=False)
class _Recorder(Scorer):
    """Scores with KVzip's and keeps each layer's ``(features, KVzip scores)`` (batch size 1)."""

    sink: dict
    needs_extras: ClassVar[frozenset[str]] = frozenset({KVZIP_EXTRA})

    def score(self, ctx: ScoringContext) -> Scores:
        s = ctx.extras[KVZIP_EXTRA].float()
        self.sink[ctx.layer_idx] = (gate_features(ctx.keys[0], ctx.values[0]).cpu(), s[0].cpu())  # [H, T, F], [H, T]
        return Scores(s)


@torch.no_grad()
def collect(model: Any, tokenizer: Any, sequences: torch.Tensor, progress=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [L, H, N, F], targets [L, H, N])`` over the rows of ``sequences [S, T]`` (``N = S * T``): the
    FastKVzip scorer's inputs and KVzip's scores of every layer, from one prefill + reconstruction pass per row."""
    from kv_hf import compressed_cache, prefill

    xs, ys = [], []
    device = next(model.parameters()).device
    for i, row in enumerate(sequences):
        sink: dict = {}
        comp = Compressor(
            scorer=_Recorder(sink),
            selector=TopKSelector(head_floor=0.0),
            store=DenseStore,
            budget=Budget(ratio=0.5, granularity="layer"),
            name="fastkvzip-targets",
        )
        cache = compressed_cache(model, comp)
        prefill(model, cache, row[None].to(device), tokenizer=tokenizer)
        layers = sorted(sink)
        xs.append(torch.stack([sink[j][0] for j in layers]))
        ys.append(torch.stack([sink[j][1] for j in layers]))
        if progress is not None:
            progress(i + 1, len(sequences))
    return torch.cat(xs, 2), torch.cat(ys, 2)


def _scores(gate: FastKVzipGate, x: torch.Tensor) -> torch.Tensor:
    """``[L, H, N]`` gate scores of every layer at once (``x [L, H, N, F]``: the layer axis as the batch axis)."""
    return torch.sigmoid(gate.logits(slice(None), x)).mean(-1)


def _loss(gate: FastKVzipGate, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the gate's mean-over-groups score against ``y``, averaged over layers and entries."""
    return F.binary_cross_entropy(_scores(gate, x).clamp(1e-6, 1 - 1e-6), y.clamp(0.0, 1.0))


def _schedule(step: int, steps: int) -> float:
    """The authors' ``lr_schedule``: 1 % warm-up, 1.0 to half-way, 0.5 to three quarters, then 0.25."""
    if step < 0.01 * steps:
        return max(step / max(0.01 * steps, 1.0), 0.01)
    return 1.0 if step < 0.5 * steps else 0.5 if step < 0.75 * steps else 0.25


@torch.no_grad()
def evaluate(gate: FastKVzipGate, x: torch.Tensor, y: torch.Tensor, keep: float = 0.1) -> dict[str, float]:
    """Held-out loss and ranking: per layer, the share of KVzip's top ``keep`` entries (over heads and tokens,
    KVzip's global order within a layer) that the gate also puts in its top ``keep``; averaged over layers."""
    recall, scores = [], _scores(gate, x)
    for layer in range(x.shape[0]):
        p, t = scores[layer].flatten(), y[layer].flatten()
        k = max(1, int(keep * t.numel()))
        a = set(t.topk(k).indices.tolist())
        recall.append(len(a & set(p.topk(k).indices.tolist())) / k)
    return {"loss": float(_loss(gate, x, y)), f"recall@{keep:g}": sum(recall) / len(recall)}


def train(
    gate: FastKVzipGate,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int = 1500,
    batch: int = 1000,
    lr: float = 0.2,
    seed: int = 0,
    held_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    eval_every: int = 250,
    log=print,
) -> list[dict[str, float]]:
    """Fit ``gate`` on ``(x, y)`` (from :func:`collect`) with the authors' recipe; returns the evaluation history."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(gate.parameters(), lr=lr, momentum=0.9)
    n = x.shape[2]
    history, t0 = [], time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, n, (min(batch, n),), generator=gen)
        for g in opt.param_groups:
            g["lr"] = lr * _schedule(step, steps)
        opt.zero_grad(set_to_none=True)
        loss = _loss(gate, x[:, :, idx], y[:, :, idx])
        loss.backward()
        opt.step()
        if (held_out is not None and (step + 1) % eval_every == 0) or step + 1 == steps:
            rec = {"step": step + 1, "train_loss": float(loss.detach()), "seconds": time.perf_counter() - t0}
            if held_out is not None:
                rec |= {f"held_out_{k}": v for k, v in evaluate(gate, *held_out).items()}
            history.append(rec)
            log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()))
    return history
