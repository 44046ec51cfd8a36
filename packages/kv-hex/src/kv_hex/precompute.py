"""Precompute HEX masks for a model's shapes, offline (HEX §3.2: the masks depend only on ``(n, d, ρ)``).

``precompute(...)`` generates (and LRU-caches) every mask a model will use and returns their tables; ``save`` /
``load`` write and read them as one ``.npz`` file, and :func:`load` puts them in the cache so a serving process does
not draw them again. The ``kv-hex-masks`` command does the same from the shell::

    kv-hex-masks --heads 3 --head-dim 64 --lengths 96,192,288 --out masks.npz
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable

import numpy as np

from kv_hex.expander import MaskTable, expander_mask

__all__ = ["load", "main", "precompute", "save"]


def precompute(
    heads: int, head_dim: int, lengths: Iterable[int], rho: float = 0.03125, scope: str = "layer", seed=None
) -> dict[tuple[int, int], MaskTable]:
    """Expander masks ``{(n, d): table}`` for segments of ``lengths`` tokens of a model with ``heads`` KV heads of
    ``head_dim`` channels (``d = heads·head_dim`` at ``scope="layer"``, ``head_dim`` at ``"head"``)."""
    if scope not in ("layer", "head"):
        raise ValueError(f"scope must be 'layer' or 'head', got {scope!r}")
    d = heads * head_dim if scope == "layer" else head_dim
    return {(int(n), d): expander_mask(int(n), d, float(rho), seed) for n in lengths}


def save(path: str, tables: dict[tuple[int, int], MaskTable], rho: float, seed=None) -> None:
    """Write ``tables`` to ``path`` (``.npz``: one ``cols_<n>_<d>`` array each, plus ``rho`` and ``seed``)."""
    arrays = {f"cols_{n}_{d}": t.cols for (n, d), t in tables.items()}
    np.savez_compressed(path, rho=np.float64(rho), seed=np.int64(-1 if seed is None else seed), **arrays)


def load(path: str) -> dict[tuple[int, int], MaskTable]:
    """Read a file written by :func:`save` and check each table against a fresh draw's degrees; the masks are then
    in :func:`kv_hex.expander.expander_mask`'s cache (drawn once, compared bit for bit with the file)."""
    with np.load(path) as f:
        rho = float(f["rho"])
        seed = None if int(f["seed"]) < 0 else int(f["seed"])
        out = {}
        for key in f.files:
            if not key.startswith("cols_"):
                continue
            n, d = (int(x) for x in key.split("_")[1:])
            table = expander_mask(n, d, rho, seed)
            if not np.array_equal(table.cols, f[key]):
                raise ValueError(f"{path}: the mask for (n={n}, d={d}) differs from this version's draw")
            out[(n, d)] = table
    return out


def main(argv: list[str] | None = None) -> int:
    """``kv-hex-masks``: precompute and save the masks for a model's shapes; prints one line per mask."""
    p = argparse.ArgumentParser(prog="kv-hex-masks", description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, required=True, help="KV heads per layer")
    p.add_argument("--head-dim", type=int, required=True, help="channels per head")
    p.add_argument("--lengths", required=True, help="segment lengths, comma-separated (multiples of the block)")
    p.add_argument("--rho", type=float, default=0.03125, help="density (default 0.03125, HEX §4.2)")
    p.add_argument("--scope", default="layer", choices=("layer", "head"))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None, help="write the tables to this .npz file")
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    t0 = time.perf_counter()
    tables = precompute(a.heads, a.head_dim, lengths, a.rho, a.scope, a.seed)
    for (n, d), t in tables.items():
        s2 = "-" if t.sigma2 is None else f"{t.sigma2:.3f}"
        bound = "not checked" if t.bound is None else f"{t.bound:.3f}"
        print(f"n={n} d={d} d1={t.d1} d2={t.d2} sigma2={s2} bound={bound} tries={t.tries} bytes={t.nbytes}")
    print(f"{len(tables)} masks in {time.perf_counter() - t0:.2f} s")
    if a.out:
        save(a.out, tables, a.rho, a.seed)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
