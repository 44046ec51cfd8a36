"""Triton kernel: the heavy-hitter accumulator of HEX after a decode step (§3.3), in one launch.

``out[s·T + t] = acc[s·T + t] + Σ_r exp(logits[s, t, r] - lse[s, r])`` (0 where either is ``-inf``): the attention
probability of every entry of a part, summed over the query rows of its head's GQA group, added to what the entry
had accumulated -- where the PyTorch form takes five operations (subtract, exponentiate, clear the NaNs of unseen
rows, sum, add). Program ``(s, j)`` owns ``BLOCK_T`` entries of head ``s``; the lengths are not specialised, so one
compiled variant serves a whole decode. The reference is :func:`kv_hex.kernels.reference.accumulate_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _accumulate_kernel(acc_ptr, lg_ptr, lse_ptr, out_ptr, T, R, HAS_ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_R: tl.constexpr):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    tmask = t < T
    rmask = r < R
    lse = tl.load(lse_ptr + s * R + r, mask=rmask, other=float("-inf"))
    lg = tl.load(lg_ptr + (s * T + t[:, None]) * R + r[None, :], mask=tmask[:, None] & rmask[None, :],
                 other=float("-inf"))  # fmt: skip
    seen = (lg != float("-inf")) & (lse != float("-inf"))[None, :]
    p = tl.where(seen, tl.exp(lg - tl.where(lse == float("-inf"), 0.0, lse)[None, :]), 0.0)
    total = tl.sum(p, axis=1)
    if HAS_ACC:
        total += tl.load(acc_ptr + s * T + t, mask=tmask, other=0.0)
    tl.store(out_ptr + s * T + t, total, mask=tmask)


def accumulate_attention_triton(
    acc: torch.Tensor | None, logits: torch.Tensor, lse: torch.Tensor, *, block_t: int = 64, num_warps: int = 4
) -> torch.Tensor:
    """Triton :func:`~kv_hex.kernels.reference.accumulate_attention` (same arguments, same results up to float32
    summation order); ``block_t`` entries per program."""
    S, T, R = logits.shape
    out = torch.empty(S * T, dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    lg = logits.float().contiguous()
    ls = lse.float().contiguous()
    a = acc.float().contiguous() if acc is not None else out
    block_r = max(2, 1 << (max(R, 1) - 1).bit_length())
    grid = (S, triton.cdiv(T, block_t))
    _accumulate_kernel[grid](a, lg, ls, out, T, R, HAS_ACC=acc is not None, BLOCK_T=block_t, BLOCK_R=block_r,
                             num_warps=num_warps)  # fmt: skip
    return out
