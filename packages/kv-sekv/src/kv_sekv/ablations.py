"""SEKV's Table 5 ablation "w/o trained zoom-in" (SEKV App. C) as a router source and a compressor.

``sekv_untrained()`` is :func:`kv_sekv.sekv` with the trained router replaced by
:meth:`~kv_sekv.SEKVRouter.untrained` of the same shapes as the shipped one: routing projections ``W`` are a fixed
semi-orthogonal draw, ``τ = τ_init`` everywhere (one threshold for every head) and the gate network keeps every
basis component. Everything else — segmentation, summaries, bases, the budget cap — is SEKV's. The other Table 5
ablations (no SVD reconstruction, fixed-length instead of entropy-guided segmentation) are not offered yet.
"""

from __future__ import annotations

from kv_sekv.compressor import sekv
from kv_sekv.router import SEKVRouter, ShippedRouter
from kvcore import Compressor

__all__ = ["UntrainedRouter", "sekv_untrained"]


class UntrainedRouter:
    """A :class:`~kv_sekv.router.RouterSource`: the deterministic untrained router with the shapes (and model
    identity) of ``like`` (the shipped SmolLM2-135M router by default), built when first needed."""

    def __init__(self, like: ShippedRouter | None = None, seed: int = 0) -> None:
        self.like = ShippedRouter() if like is None else like
        self.seed = seed
        self._router: SEKVRouter | None = None

    def resolve(self) -> SEKVRouter:
        if self._router is None:
            t = self.like.resolve()
            self._router = SEKVRouter.untrained(
                t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim, t.config, t.model_id, seed=self.seed
            )
        return self._router

    def __repr__(self) -> str:
        return f"UntrainedRouter(like={self.like!r}, seed={self.seed})"


def sekv_untrained(budget: float | None = None, name: str = "sekv-untrained") -> Compressor:
    """SEKV without its trained zoom-in (Table 5): :func:`kv_sekv.sekv` with an :class:`UntrainedRouter`."""
    return sekv(budget=budget, router=UntrainedRouter(), name=name)
