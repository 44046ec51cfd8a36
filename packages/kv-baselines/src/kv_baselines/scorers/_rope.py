"""Rotary position embeddings as the scorers need them: undo a token's rotation, average future rotations.

HF's layout (``rotate_half``): dimension ``i < r/2`` is paired with ``i + r/2``, where ``r = 2 * len(inv_freq)`` is
the rotary dimension (``r < D`` for partial rotary embeddings: the remaining dimensions are not rotated). A rotation
by angles ``θ = p * inv_freq`` is ``x cos θ + rotate_half(x) sin θ``; its inverse is the rotation by ``-θ``.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dimension (HF's ``rotate_half``, the matrix ``P`` of kvpress)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dimensions of ``x`` by the angle pairs (``cos``/``sin`` per frequency,
    broadcastable to ``x[..., :r/2]``); the other dimensions pass through."""
    r = 2 * cos.shape[-1]
    c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    head = x[..., :r] * c + rotate_half(x[..., :r]) * s
    return torch.cat((head, x[..., r:]), dim=-1)


def unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE vectors from post-RoPE ``x`` ``[B, H, W, D]`` at integer ``positions`` ``[B, W]``."""
    angles = positions.double()[:, None, :, None] * inv_freq.double()  # [B, 1, W, r/2]
    return rotate(x.double(), angles.cos(), -angles.sin()).to(x.dtype)


def mean_rotation(start: torch.Tensor, n: int, inv_freq: torch.Tensor, dim: int) -> torch.Tensor:
    """``[B, D, D]``: the mean of the rotation matrices of positions ``start[b] .. start[b] + n - 1``.

    The mean of rotations by ``θ_f`` is ``diag(mean cos θ_f) + diag(mean sin θ_f) · P`` on the rotary dimensions
    (identity on the others): kvpress ``ExpectedAttentionPress.get_query_statistics``'s averaged ``R``.
    """
    f = start.double()[:, None] + torch.arange(n, dtype=torch.float64, device=start.device)  # [B, n]
    angles = f[..., None] * inv_freq.double().to(start.device)  # [B, n, r/2]
    c, s = angles.cos().mean(1), angles.sin().mean(1)  # [B, r/2]
    eye = torch.eye(dim, dtype=torch.float64, device=start.device).expand(start.shape[0], dim, dim)
    # column j of R is R e_j: rotate every basis vector
    return rotate(eye.transpose(1, 2), c[:, None, :], s[:, None, :]).transpose(1, 2)
