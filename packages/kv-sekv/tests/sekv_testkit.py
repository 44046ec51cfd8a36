"""Shared helpers of the kv-sekv tests: small configs, routers and written stores."""

from __future__ import annotations

import torch

from kv_sekv import SEKVConfig, SEKVRouter, sekv
from kvcore import ScoringContext

SMALL = SEKVConfig(window=4, min_span=3, max_rank=8, proj_dim=8)


def router(L=2, Hq=4, Hkv=2, D=16, config=SMALL, gate_bias=30.0, tau=None, seed=0):
    r = SEKVRouter.untrained(L, Hq, Hkv, D, config, seed=seed, gate_bias=gate_bias)
    if tau is not None:
        with torch.no_grad():
            r.tau.fill_(tau)
    return r


def context(B=1, Hkv=2, T=40, D=16, seed=0, layer=0, surprisal=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    h = torch.rand(B, T, generator=g) * 4 if surprisal is None else surprisal
    return ScoringContext(k, v, extras={"surprisal": h}, layer_idx=layer)


def written(budget=1.0, r=None, config=SMALL, strict=False, **ctx):
    r = router(config=config) if r is None else r
    c = sekv(budget, r, config, strict=strict)
    x = context(**ctx)
    return c.compress(x), x, c
