"""Scratch of the HubKV kernels, reused across calls, and its asynchronous error flag.

The kernels (:mod:`kv_hubkv.triton_kernel`) need device scratch: every chunk's partial statistics and every row's
head factors, a chunk counter per row (the row's last chunk merges the statistics), the call's largest refined
score (which sets the protected score), a call counter (the last program resets the counters and the maximum for
the next call) and an error flag. Allocating them per call costs allocator work and a memset launch;
a :class:`RefineWorkspace` holds them across calls (and across the calls a CUDA graph replays).

The value checks of :func:`kv_hubkv.refine` (finite scores, non-negative unprotected scores; paper §3.1) are folded
into the kernel: it raises the flag (``1`` = a non-finite score, ``2`` = a negative unprotected score) on the device.
Reading the flag is the only host synchronisation of a call: ``check="eager"`` reads it before returning (the
default, and the contract of :func:`kv_hubkv.refine`); ``check="deferred"`` leaves it set until
:meth:`RefineWorkspace.raise_if_error` reads it -- e.g. once per batch, after the selection that consumes the
scores -- so the hot path has no synchronisation.
"""

from __future__ import annotations

import torch

from .checks import NEGATIVE_MSG, NONFINITE_MSG

__all__ = ["NEG_INF_KEY", "RefineWorkspace"]

#: ``-inf`` as the kernels' order-preserving int32 key of a float32 (the bits of ``-inf`` with the 31 low bits
#: flipped): the value the call's maximum starts from
NEG_INF_KEY = -2139095041


class RefineWorkspace:
    """Device scratch of :func:`kv_hubkv.triton_kernel.refine_triton_config` and its sticky error flag.

    Buffers are allocated on first use per device and grown (never shrunk) when a call has more rows; their
    addresses stay fixed otherwise, which a captured CUDA graph relies on.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._partials: dict[str, torch.Tensor] = {}

    def buffers(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(per-row chunk counters int32 [>= rows], call counter int32 [1], flag int32 [1], the call's largest
        refined score as an order-preserving int32 key [1])`` on ``device``. The kernels leave the counters at 0
        and the maximum at :data:`NEG_INF_KEY` (-inf) after every call."""
        key = str(device)
        have = self._bufs.get(key)
        if have is None or have[0].numel() < rows:
            if have is None:
                counter = torch.zeros(1, dtype=torch.int32, device=device)
                flag = torch.zeros(1, dtype=torch.int32, device=device)
                zmax = torch.full((1,), NEG_INF_KEY, dtype=torch.int32, device=device)
            else:
                _, counter, flag, zmax = have
            rowcount = torch.zeros(max(rows, 1), dtype=torch.int32, device=device)
            have = self._bufs[key] = (rowcount, counter, flag, zmax)
        return have

    def partials(self, numel: int, device: torch.device) -> torch.Tensor:
        """float32 scratch of ``>= numel`` elements on ``device``: the per-chunk statistics the first launch writes
        and the second merges (grown, never shrunk)."""
        key = str(device)
        have = self._partials.get(key)
        if have is None or have.numel() < numel:
            have = self._partials[key] = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
        return have

    def error_code(self) -> int:
        """The flag's value (one host synchronisation per device): 0 = no error, 1 = non-finite, 2 = negative."""
        return max((int(b[2].item()) for b in self._bufs.values()), default=0)

    def raise_if_error(self) -> None:
        """Raise the reference's ``ValueError`` if a call since the last check saw bad scores (and clear the flag)."""
        code = self.error_code()
        if code:
            for _, _, flag, _ in self._bufs.values():
                flag.zero_()
            raise ValueError(NONFINITE_MSG if code == 1 else NEGATIVE_MSG)
