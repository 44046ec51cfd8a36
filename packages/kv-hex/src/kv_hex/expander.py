"""Static expander masks over (token × channel): (d₁, d₂)-biregular bipartite graphs at density ρ that meet the
Ramanujan bound (HEX §3.2, App. A.1-A.3).

A mask of shape ``(n, d)`` connects every token (row) to exactly ``d₁ = round(ρ·d)`` channels and every channel
(column) to ``d₂ = n·d₁/d`` tokens. It is drawn at random with a configuration model (row stubs against shuffled
column stubs, duplicate edges repaired by random swaps) and accepted only when its second singular value meets
the Ramanujan bound ``σ₂ ≤ √(d₁−1) + √(d₂−1)`` (App. A.2, construction (2): "random generation of bi-regular
bipartite graphs and checking for Ramanujan criteria"); otherwise it is redrawn. When ``n·d₁/d`` is not an integer
(ρ = 4.6875 % with n = 96, spec A3) the column degrees are balanced ``⌊·⌋``/``⌈·⌉`` and the mask is
*near-biregular*: the bound, defined for biregular graphs, is not checked. The bound is also only checked where it
is defined (``d₁, d₂ ≥ 2``).

Masks are static: a pure function of ``(n, d, ρ, seed)`` (the seed defaults to one derived from ``(n, d, ρ)``),
never of the cache's values. They are stored as a compact fixed-degree index table ``cols [n, d₁]`` (int16 when
``d < 32768``), held in an LRU cache, regenerated on demand, and can be precomputed for a model's shapes
(:func:`kv_hex.precompute.precompute`).
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = [
    "MaskTable",
    "degrees",
    "expander_mask",
    "mask_table",
    "ramanujan_bound",
    "random_mask",
    "singular_values",
]

MAX_TRIES = 200
"""Draws before :func:`expander_mask` gives up on the Ramanujan bound (the spec's numpy check passed first try)."""


def degrees(n: int, d: int, rho: float) -> tuple[int, int | None]:
    """``(d₁, d₂)`` of an ``(n, d)`` mask at density ``rho``: ``d₁ = round(ρ·d)`` channels per token and
    ``d₂ = n·d₁/d`` tokens per channel (``None`` when it is not an integer: near-biregular, spec A3)."""
    for name, v in (("n", n), ("d", d)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(rho, bool) or not isinstance(rho, float | int) or not 0.0 < float(rho) < 1.0:
        raise ValueError(f"rho must lie in the open interval (0, 1), got {rho!r}")
    d1 = round(float(rho) * d)
    return d1, (n * d1 // d if (n * d1) % d == 0 else None)


def ramanujan_bound(d1: int, d2: int) -> float:
    """``√(d₁−1) + √(d₂−1)`` (Def. 2 / §3.2)."""
    return math.sqrt(d1 - 1) + math.sqrt(d2 - 1)


def _derived_seed(n: int, d: int, rho: float, kind: str) -> int:
    return zlib.crc32(f"kv-hex/{kind}/{n}/{d}/{float(rho)!r}".encode())


@dataclass(frozen=True)
class MaskTable:
    """A fixed-degree mask: token ``t`` keeps channels ``cols[t]`` (sorted) in full precision.

    Attributes
    ----------
    n, d : int
        Tokens and channels.
    cols : numpy.ndarray
        ``[n, d₁]`` int16/int32 channel indices (read-only).
    d1 : int
        Channels per token.
    d2 : int or None
        Tokens per channel (``None``: near-biregular or random, column degrees vary).
    sigma2 : float or None
        Second singular value of the 0/1 matrix (``None`` when not computed).
    bound : float or None
        The Ramanujan bound it was checked against (``None``: not checked — near-biregular, degree < 2, random).
    tries : int
        Draws it took.
    kind : str
        ``"expander"`` or ``"random"``.
    """

    n: int
    d: int
    cols: np.ndarray
    d1: int
    d2: int | None
    sigma2: float | None
    bound: float | None
    tries: int
    kind: str

    @property
    def nbytes(self) -> int:
        """Bytes of the index table (shared by every layer that uses it)."""
        return int(self.cols.nbytes)

    def dense(self) -> np.ndarray:
        """The ``[n, d]`` bool mask."""
        return dense_mask(self)


def singular_values(mask: np.ndarray, k: int = 2) -> np.ndarray:
    """The ``k`` largest singular values of a 0/1 matrix (dense SVD when small, ``scipy.sparse`` otherwise)."""
    m = np.asarray(mask, dtype=np.float64)
    if min(m.shape) <= 512 or k >= min(m.shape) - 1:
        return np.linalg.svd(m, compute_uv=False)[:k]
    from scipy.sparse import csr_matrix
    from scipy.sparse.linalg import svds

    s = svds(csr_matrix(m), k=k, return_singular_vectors=False, random_state=0)
    return np.sort(s)[::-1]


def _configuration(n: int, d: int, d1: int, rng: np.random.Generator) -> np.ndarray:
    """Random ``[n, d₁]`` channel table: row stubs against shuffled, balanced column stubs; duplicate edges
    of a row repaired by swapping one endpoint with a random edge of another row."""
    total = n * d1
    base, extra = divmod(total, d)
    col_deg = np.full(d, base)
    col_deg[rng.permutation(d)[:extra]] += 1  # balanced ⌊·⌋/⌈·⌉ degrees (exact when biregular)
    stubs = rng.permutation(np.repeat(np.arange(d), col_deg))
    table = stubs.reshape(n, d1)
    for _ in range(1000):
        srt = np.sort(table, axis=1)
        dup_rows = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0] if d1 > 1 else np.zeros(0, int)
        if dup_rows.size == 0:
            return srt
        for r in dup_rows.tolist():  # one random swap per row holding a duplicate edge, then check again
            _, first = np.unique(table[r], return_index=True)
            dup_j = next((j for j in range(d1) if j not in set(first.tolist())), None)
            if dup_j is None:  # fixed by an earlier swap of this pass
                continue
            r2, j2 = int(rng.integers(n)), int(rng.integers(d1))
            a, b = table[r, dup_j], table[r2, j2]
            if r2 != r and b not in table[r] and a not in table[r2]:
                table[r, dup_j], table[r2, j2] = b, a
    raise RuntimeError(f"could not repair duplicate edges of a ({n}, {d}) mask with d1={d1}")  # pragma: no cover


def _table_dtype(d: int) -> np.dtype:
    return np.dtype(np.int16) if d < 2**15 else np.dtype(np.int32)


@functools.lru_cache(maxsize=256)
def expander_mask(n: int, d: int, rho: float, seed: int | None = None) -> MaskTable:
    """The HEX expander mask of ``n`` tokens × ``d`` channels at density ``rho`` (LRU-cached, deterministic).

    Parameters
    ----------
    n, d : int
        Tokens (the segment being compressed) and channels (``H_kv·d_h`` at layer scope, ``d_h`` at head scope).
    rho : float
        Fraction of elements kept, in (0, 1). ``d₁ = round(ρ·d)``; ``d₁ = 0`` gives an empty mask.
    seed : int, optional
        Draw seed; ``None`` derives a fixed one from ``(n, d, ρ)``. Retries use ``(seed, attempt)``.

    Returns
    -------
    MaskTable
        Biregular masks with ``d₁, d₂ ≥ 2`` meet ``σ₂ ≤ √(d₁−1)+√(d₂−1)`` (``bound`` set); others are returned
        after the duplicate repair without a spectral check (``bound=None``).

    Raises
    ------
    ValueError
        ``n``/``d`` not ints >= 1, ``rho`` outside (0, 1), or no draw met the bound in :data:`MAX_TRIES`
        (degrees too small for a Ramanujan graph of this shape).
    """
    d1, d2 = degrees(n, d, rho)
    seed = _derived_seed(n, d, rho, "expander") if seed is None else int(seed)
    dt = _table_dtype(d)
    if d1 == 0:
        return MaskTable(n, d, np.zeros((n, 0), dt), 0, 0, None, None, 0, "expander")
    check = d2 is not None and d1 >= 2 and d2 >= 2 and d1 < d
    bound = ramanujan_bound(d1, d2) if check else None
    best = None
    for attempt in range(MAX_TRIES):
        rng = np.random.default_rng([seed, attempt])
        table = _configuration(n, d, d1, rng)
        if not check:
            best = (table, None, attempt + 1)
            break
        m = np.zeros((n, d), dtype=bool)
        m[np.repeat(np.arange(n), d1), table.reshape(-1)] = True
        s2 = float(singular_values(m, 2)[1])
        if s2 <= bound + 1e-9:
            best = (table, s2, attempt + 1)
            break
    if best is None:
        raise ValueError(
            f"no ({d1}, {d2})-biregular mask of shape ({n}, {d}) met the Ramanujan bound {bound:.3f} in {MAX_TRIES} "
            "draws; use a larger rho or mask_scope='layer'"
        )
    table, s2, tries = best
    cols = table.astype(dt)
    cols.setflags(write=False)
    return MaskTable(n, d, cols, d1, d2, s2, bound, tries, "expander")


@functools.lru_cache(maxsize=256)
def random_mask(n: int, d: int, rho: float, seed: int | None = None) -> MaskTable:
    """A random *unstructured* mask with the same number of kept elements as :func:`expander_mask` (``n·d₁``),
    drawn uniformly without the degree constraints (the control for §3.2's structural claim).

    Stored as a variable-degree table padded to the largest row degree with ``-1`` (``d1`` is that width)."""
    d1, _ = degrees(n, d, rho)
    seed = _derived_seed(n, d, rho, "random") if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    flat = np.sort(rng.choice(n * d, size=n * d1, replace=False)) if d1 else np.zeros(0, np.int64)
    rows, cols = np.divmod(flat, d)
    counts = np.bincount(rows, minlength=n)
    width = int(counts.max()) if counts.size and d1 else 0
    table = np.full((n, width), -1, dtype=_table_dtype(d))
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    table[rows, np.arange(flat.size) - start[rows]] = cols
    table.setflags(write=False)
    return MaskTable(n, d, table, width, None, None, None, 1, "random")


def mask_table(kind: str, n: int, d: int, rho: float, seed: int | None = None) -> MaskTable | None:
    """The mask of ``kind`` (``"expander"``, ``"random"``; ``"none"`` gives ``None``)."""
    if kind == "expander":
        return expander_mask(n, d, rho, seed)
    if kind == "random":
        return random_mask(n, d, rho, seed)
    if kind == "none":
        return None
    raise ValueError(f"kind must be 'expander', 'random' or 'none', got {kind!r}")


def dense_mask(table: MaskTable) -> np.ndarray:
    """``[n, d]`` bool of any table (``-1`` entries of a random table are padding)."""
    m = np.zeros((table.n, table.d), dtype=bool)
    if table.cols.size:
        r = np.repeat(np.arange(table.n), table.cols.shape[1])
        c = table.cols.reshape(-1).astype(np.int64)
        ok = c >= 0
        m[r[ok], c[ok]] = True
    return m
