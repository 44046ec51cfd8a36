"""docs/quickstart.md, "Compose your own": the example as written (HubKV-refined SnapKV scores, ``TopKSelector``,
``kivi(4).store``, ratio 0.75) holds a KIVI-4 cache -- the bytes of ``kivi(4, evict=hubkv(snapkv(0.75)))``, well
below SnapKV 0.75's -- not the full-precision cache a quantizing store gets from a keep-or-evict plan."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kv_baselines import kivi, snapkv
from kv_hubkv import hubkv
from kvcore import FULL

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


def _example() -> dict:
    """Run the first Python block under the "Compose your own" heading as written; its namespace."""
    text = QUICKSTART.read_text()
    section = text[text.index("## Compose your own") :]
    code = re.search(r"^```python\n(.*?)^```", section, re.M | re.S).group(1)
    namespace: dict = {}
    exec(compile(code, f"{QUICKSTART.name} (Compose your own)", "exec"), namespace)
    return namespace


def test_documented_composition_holds_kivi4_bytes():
    ns = _example()
    comp = ns["comp"]
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 512, 64
    ctx = ns["ScoringContext"](
        keys=torch.randn(B, H, T, D, generator=g),
        values=torch.randn(B, H, T, D, generator=g),
        queries=torch.randn(B, 4, 64, D, generator=g),
    )
    store = comp.compress(ctx)
    ready_made = kivi(4, evict=hubkv(snapkv(0.75))).compress(ctx)
    full = snapkv(0.75).compress(ctx)
    kept = T - int(0.75 * T)
    assert store.seq_lengths().tolist() == [[kept] * H] == full.seq_lengths().tolist()
    # the ready-made composition's bytes, entries and tiers
    assert store.nbytes() == ready_made.nbytes()
    got, want = store.read(), ready_made.read()
    assert torch.equal(got.positions, want.positions) and torch.equal(got.keys, want.keys)
    tiers = store.tiers()
    assert torch.equal(tiers.key_bits, ready_made.tiers().key_bits)
    # KIVI's layout at 128 kept entries per head: every key at 4 bits (one whole residual block), values in the
    # full-precision residual
    assert tiers.key_bits.unique().tolist() == [4] and tiers.bits_for_values.unique().tolist() == [FULL]
    # well below SnapKV 0.75's full-precision cache: the keys shrink to at most a quarter of their float32 bytes
    # (4-bit codes are an eighth; per-channel group scales and zeros add the rest)
    key_bytes = B * H * kept * D * ctx.keys.element_size()
    assert full.nbytes() - store.nbytes() >= 0.75 * key_bytes
