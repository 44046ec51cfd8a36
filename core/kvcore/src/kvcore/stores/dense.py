"""A dense full-precision store with real, ragged per-head eviction."""

from __future__ import annotations

import functools

import torch

from kvcore.checks import (
    check_append,
    check_batch_index,
    check_finite,
    check_int,
    check_kv,
    check_positions,
    values_checked,
)
from kvcore.memory import storage_bytes
from kvcore.plan import EVICT, FULL, Plan
from kvcore.protocols import Store
from kvcore.view import KVView


@functools.cache
def _zero_bias(device: torch.device) -> torch.Tensor:
    """One float32 zero per device, expanded to a bias-free view's ``[B, H, T]`` logit bias: reading a uniform
    store allocates and fills no bias (its consumers skip it, ``KVView.bias_free``; an in-place write to the
    expanded view is refused by torch rather than shared)."""
    return torch.zeros(1, 1, 1, device=device)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


class DenseStore(Store):
    """One layer's cache as one flat buffer of ragged per-(batch, head) segments.

    Kept entries are gathered into a ``[N, D]`` buffer (``N`` = entries kept over all heads), so evicted
    entries hold no memory; each segment has a capacity so decode-time appends are amortised. ``read``
    pads heads to the longest one and marks padding with ``-inf`` logit bias and position ``-1``; when every
    head holds the same number of entries in equal capacities (per-head top-k, then appends) its keys/values are
    zero-copy views of the buffers, valid until the next mutating call.

    Parameters
    ----------
    growth : int
        Extra slots per head reserved when an append outgrows a segment (held memory, counted by ``nbytes``).
    """

    supported_bits = frozenset({EVICT, FULL})
    can_attend = False  # decode attends over read(): the view is zero-copy when heads hold equal segments

    def __init__(self, growth: int = 64) -> None:
        self.growth = check_int("growth", growth, low=0)
        self.reset()

    # -- state -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  # int32 [N]
        self._start: torch.Tensor | None = None  # int64 [B*H]
        self._len: torch.Tensor | None = None
        self._cap: torch.Tensor | None = None
        self._shape: tuple[int, int] = (0, 0)
        self._changed()

    def _changed(self) -> None:
        """Forget what is known on the host about the layout (after any change other than an append)."""
        self._uniform: bool | None = None  # every segment has the same length and capacity (None: not known)
        self._T: int | None = None  # with _uniform: every segment's length and capacity, held on the host
        self._C: int | None = None
        self._last: torch.Tensor | None = None  # [B] largest position held per row (None: not known)

    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor, *, held: bool) -> None:
        """Float ``[B, H, T, D]`` keys and values of one dtype and shape; with ``held``, matching the held cache."""
        held_as = None if not held or self._k is None else (*self._shape, self._k.shape[-1], self._k.dtype)
        check_kv(keys, values, held=held_as)

    # -- protocol --------------------------------------------------------------------------------------
    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """Replace the content with the entries ``plan`` keeps. Validates everything (finite kept keys/values,
        positions) before changing anything: a rejected call leaves the store as it was."""
        self._check_kv(keys, values, held=False)
        B, H, T, _D = keys.shape
        if not isinstance(plan, Plan) or tuple(plan.key_bits.shape) != (B, H, T):
            raise ValueError(f"plan must be a kvcore.Plan of shape [B={B}, H={H}, T={T}]")
        if plan.tiers() - self.supported_bits:
            raise ValueError(f"DenseStore holds tiers {sorted(self.supported_bits)}; plan uses {sorted(plan.tiers())}")
        keep = plan.keep_keys.to(keys.device)
        if not torch.equal(keep, plan.keep_values.to(keys.device)):
            raise ValueError("DenseStore needs the same kept set for keys and values")
        check_positions("positions", positions, (B, T), keep=keep)
        k, v = check_finite("keys", keys[keep]), check_finite("values", values[keep])
        self.reset()
        self._k, self._v = k, v
        self._pos = positions[:, None, :].expand(B, H, T)[keep].to(torch.int32)
        self._len = keep.sum(-1).flatten()
        self._cap = self._len.clone()
        self._start = _exclusive_cumsum(self._cap)
        self._shape = (B, H)
        self._changed()

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``[B, H, n, D]`` entries after every held one (positions ``[B, n]`` beyond those held in their row);
        validated first (:func:`kvcore.checks.check_append`), so a rejected call changes nothing.

        When every head holds the same number of entries, the lengths and capacities are known on the host and the
        entries are written into the reserved slots in place: no host sync unless values are checked."""
        self._check_kv(keys, values, held=True)
        B, H, n, D = keys.shape
        if self._k is None:
            self.write(
                keys, values, Plan.from_keep(torch.ones(B, H, n, dtype=torch.bool, device=keys.device)), positions
            )
            return
        after = self._last_positions() if values_checked(keys) else None
        positions = check_append(keys, values, positions, after)
        if self._uniform is None:
            self._learn_layout()
        if self._uniform:
            T, C = self._T, self._C
            if T + n > C:  # every segment grows to the same capacity: still uniform
                self._relayout(torch.arange(B * H, device=keys.device), self._len + n + self.growth)
                C = T + n + self.growth
                self._uniform, self._T, self._C = True, T, C
            self._k.view(B, H, C, D)[:, :, T : T + n] = keys
            self._v.view(B, H, C, D)[:, :, T : T + n] = values
            self._pos.view(B, H, C)[:, :, T : T + n] = positions[:, None, :]  # int32 by the copy itself
            self._T = T + n
        else:
            if bool((self._len + n > self._cap).any()):
                self._relayout(torch.arange(B * H, device=keys.device), self._len + n + self.growth)
            idx = ((self._start + self._len)[:, None] + torch.arange(n, device=keys.device)).flatten()
            self._k[idx] = keys.reshape(-1, D)
            self._v[idx] = values.reshape(-1, D)
            self._pos[idx] = positions[:, None, :].expand(B, H, n).reshape(-1).to(torch.int32)
        self._len = self._len + n
        if n:  # its own storage (counted by nbytes), not the caller's; unchecked, found again when asked
            self._last = positions[:, -1].clone() if after is not None else None

    def _learn_layout(self) -> None:
        """Read (one host sync) whether every segment has the same length and capacity, and if so which."""
        n = self._len.numel()
        self._uniform = bool(n) and bool((self._len == self._len[0]).all() & (self._cap == self._cap[0]).all())
        if self._uniform:
            self._T, self._C = int(self._len[0]), int(self._cap[0])

    def read(self, query: torch.Tensor | None = None) -> KVView:
        B, H = self._shape
        if self._k is None:
            raise ValueError("read() on an empty store: write() or append() first")
        if self._uniform is None:
            self._learn_layout()
        if self._uniform:
            return self._read_uniform(B, H)
        T = int(self._len.max()) if self._len.numel() else 0
        ar = torch.arange(T, device=self._k.device)
        valid = ar < self._len[:, None]
        idx = torch.where(valid, self._start[:, None] + ar, 0)
        k = self._k[idx].masked_fill(~valid[..., None], 0).view(B, H, T, self._k.shape[-1])
        v = self._v[idx].masked_fill(~valid[..., None], 0).view(B, H, T, self._v.shape[-1])
        pos = torch.where(valid, self._pos[idx].long(), -1).view(B, H, T)
        bias = torch.zeros(B, H, T, device=k.device).masked_fill(~valid.view(B, H, T), float("-inf"))
        return KVView(k, v, pos, bias)

    def _read_uniform(self, B: int, H: int) -> KVView:
        """Equal segments: segment ``i`` starts at ``i * cap``, so the buffers reshape to ``[B, H, cap, D]``."""
        T, cap, D = self._T, self._C, self._k.shape[-1]
        k = self._k.view(B, H, cap, D)[:, :, :T]
        v = self._v.view(B, H, cap, D)[:, :, :T]
        pos = self._pos.view(B, H, cap)[:, :, :T].long()
        return KVView(k, v, pos, _zero_bias(k.device).expand(B, H, T), bias_free=True)

    def tiers(self) -> Plan:
        """``FULL`` for every held entry, ``EVICT`` for padding, laid out like :meth:`read`."""
        view = self.read()
        return Plan(torch.where(view.valid, FULL, EVICT).to(torch.uint8))

    def retier(self, plan: Plan) -> None:
        """Evict the entries ``plan`` marks ``EVICT`` (laid out like :meth:`read`); the others stay untouched.

        A full-precision store has one held tier, so re-tiering can only evict; the buffers are rebuilt with the
        kept entries only (their memory is freed) and the kept entries' bytes are copied unchanged.
        """
        view = self.read()
        valid = view.valid
        if not isinstance(plan, Plan) or tuple(plan.key_bits.shape) != tuple(valid.shape):
            raise ValueError(f"plan must be a kvcore.Plan laid out like read(): shape {tuple(valid.shape)}")
        if plan.tiers() - self.supported_bits:
            raise ValueError(
                f"DenseStore re-tiers to {sorted(self.supported_bits)} (evict or keep); "
                f"plan uses {sorted(plan.tiers())}"
            )
        keep = plan.keep_keys.to(valid.device)
        if not torch.equal(keep, plan.keep_values.to(valid.device)):
            raise ValueError("DenseStore needs the same kept set for keys and values")
        if bool((keep & ~valid).any()):
            raise ValueError("plan keeps padding entries (positions -1 in read()); padding must be EVICT")
        B, H = self._shape
        T = valid.shape[-1]
        ar = torch.arange(T, device=self._k.device)
        idx = (self._start[:, None] + ar).view(B, H, T)[keep]
        self._k, self._v, self._pos = self._k[idx], self._v[idx], self._pos[idx]
        self._len = keep.sum(-1).flatten()
        self._cap = self._len.clone()
        self._start = _exclusive_cumsum(self._cap)
        self._changed()

    def nbytes(self, device: torch.device | str | None = None) -> int:
        return storage_bytes([self._k, self._v, self._pos, self._start, self._len, self._cap, self._last], device)

    def uniform_length(self) -> int | None:
        """The number of entries every head holds, where the host knows it without a read (every head holds as many,
        learnt by a read or an append since the last other edit), else ``None``."""
        return self._T if self._uniform else None

    def seq_lengths(self) -> torch.Tensor:
        B, H = self._shape
        if self._len is None:
            return torch.zeros(B, H, dtype=torch.long)
        return self._len.view(B, H).clone()

    def _last_positions(self) -> torch.Tensor:
        """``[B]`` the largest position held in each row (``-1`` for a row holding nothing)."""
        if self._last is not None:
            return self._last
        B, H = self._shape
        last = self._pos[(self._start + self._len - 1).clamp_min(0)].long() if self._pos.numel() else self._len * 0
        return torch.where(self._len > 0, last, -1).view(B, H).amax(-1)

    def crop(self, position: int) -> None:
        check_int("position", position, low=0)
        if self._k is None:
            return
        view = self.read()
        self._len = ((view.positions >= 0) & (view.positions < position)).sum(-1).flatten()
        self._changed()

    def reorder(self, index: torch.Tensor) -> None:
        if self._k is None:
            return
        B, H = self._shape
        index = check_batch_index("index", index, B).to(self._len.device)
        segs = (index[:, None] * H + torch.arange(H, device=index.device)).flatten()
        self._shape = (index.numel(), H)
        self._relayout(segs, self._len[segs])

    # -- helpers ---------------------------------------------------------------------------------------
    def _relayout(self, segs: torch.Tensor, new_cap: torch.Tensor) -> None:
        """Rebuild the buffers holding segments ``segs`` (in that order) with capacities ``new_cap``."""
        lens = self._len[segs]
        new_start = _exclusive_cumsum(new_cap)
        # segment of every held entry via searchsorted (repeat_interleave with tensor repeats is ms-slow on CPU)
        flat = torch.arange(int(lens.sum()), device=lens.device)
        seg_of = torch.searchsorted(torch.cumsum(lens, 0), flat, right=True)
        offset = flat - _exclusive_cumsum(lens)[seg_of]
        src = self._start[segs][seg_of] + offset
        dst = new_start[seg_of] + offset
        total = int(new_cap.sum())
        for name in ("_k", "_v", "_pos"):
            old = getattr(self, name)
            new = torch.zeros((total, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[dst] = old[src]
            setattr(self, name, new)
        self._start, self._len, self._cap = new_start, lens.clone(), new_cap.clone()
        self._changed()
