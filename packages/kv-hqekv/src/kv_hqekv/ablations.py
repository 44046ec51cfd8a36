"""HqeKV's ablations of Table 6 (HqeKV §4.5, App. A.9) as ready-made compressors, against HqeKV-3.2.

* ``"no-range"`` (w/o I): the value metric without the token-range factor, so value scores equal key scores
  (``HqeKVConfig(times_range=False)``); shares and everything else as HqeKV-3.2.
* ``"random-ratio"`` (w/o III): the optimised shares replaced by a seeded random feasible draw at the same average
  bits — the 1-bit and evict shares uniform in the search's own ``[0, 1]`` square, redrawn until Eq. 3 gives
  non-negative 4- and 2-bit shares.
* ``"no-evict"`` (w/o eviction): the evict share set to 0 and Eq. 3 re-solved with the preset's 1-bit share, so
  the average bits are unchanged and every block is held.

* ``"uniform"`` (w/o II, "uniform quantization to 4, 2 and 1 bit-widths based on the opt-ratio", App. A.9.2):
  the 1-bit tier quantized uniform min-max (:class:`~kv_hqekv.uniform_one_bit.UniformOneBitQuantizer`,
  ``HqeKVConfig(one_bit="uniform")``) with HqeKV-3.2's shares; the 4- and 2-bit tiers and the groupings (keys per
  channel, values per token) are unchanged, since they are uniform already.
"""

from __future__ import annotations

import dataclasses
import random

from kv_hqekv.compressor import DEFAULT_PRESETS, hqekv
from kv_hqekv.config import HqeKVConfig
from kv_hqekv.shares import Shares, feasible, preset
from kvcore import Compressor
from kvcore.checks import check_int, check_number

__all__ = ["ABLATIONS", "ablation", "no_evict_shares", "random_shares"]

ABLATIONS: tuple[str, ...] = ("no-range", "random-ratio", "no-evict", "uniform")
"""Table 6 ablations :func:`ablation` builds (module docstring)."""


def random_shares(avg_bits: float, seed: int = 0, tries: int = 10_000) -> Shares:
    """A seeded random feasible share vector at ``avg_bits`` (Table 6 "randomly non-opt ratio").

    ``(x3, x4)`` (1-bit, evict) uniform on ``[0, 1]²`` — the space kv-lab's ``kv_lab.hqekv.search_shares`` searches —
    redrawn until Eq. 3's 4- and 2-bit shares are non-negative.

    Raises
    ------
    ValueError
        When no feasible draw turns up in ``tries`` (an ``avg_bits`` with almost no feasible region).
    """
    b = check_number("avg_bits", avg_bits, low=0.0, high=4.0)
    check_int("seed", seed)
    check_int("tries", tries, low=1)
    rng = random.Random(seed)
    for _ in range(tries):
        found = feasible(b, rng.random(), rng.random())
        if found is not None:
            return found
    raise ValueError(f"no feasible random shares at avg_bits={b} in {tries} draws")


def no_evict_shares(shares: Shares, avg_bits: float) -> Shares:
    """``shares`` without eviction: evict share 0, 1-bit share kept, 4- and 2-bit shares re-solved from Eq. 3 at
    ``avg_bits``; ``ValueError`` when that is infeasible."""
    found = feasible(avg_bits, shares.q1, 0.0)
    if found is None:
        raise ValueError(f"no feasible shares without eviction at avg_bits={avg_bits} with a 1-bit share {shares.q1}")
    return found


def ablation(kind: str, bits: float = 3.2, seed: int = 0) -> Compressor:
    """HqeKV at ``bits`` (the paper ablates HqeKV-3.2) with one Table 6 component removed.

    Parameters
    ----------
    kind : {"no-range", "random-ratio", "no-evict", "uniform"}
        Which component to remove (:data:`ABLATIONS`).
    bits : float
        Average bits; the shares start from the paper's Llama preset for it (2, 2.8, 3.2 or 3.25).
    seed : int
        Seed of the ``"random-ratio"`` draw.
    """
    if kind not in ABLATIONS:
        raise ValueError(f"kind must be one of {ABLATIONS}, got {kind!r}")
    key = next((k for k in DEFAULT_PRESETS if abs(k - bits) < 1e-9), None)
    if key is None:
        raise ValueError(f"bits must be one of {sorted(DEFAULT_PRESETS)} (a paper preset to ablate), got {bits!r}")
    base = preset(DEFAULT_PRESETS[key])
    name = f"hqekv-{bits:g}-{kind}"
    if kind == "no-range":
        return hqekv(bits, shares=base, config=dataclasses.replace(HqeKVConfig(), times_range=False), name=name)
    if kind == "random-ratio":
        return hqekv(bits, shares=random_shares(bits, seed), name=name)
    if kind == "uniform":
        return hqekv(bits, shares=base, config=dataclasses.replace(HqeKVConfig(), one_bit="uniform"), name=name)
    return hqekv(bits, shares=no_evict_shares(base, bits), name=name)
