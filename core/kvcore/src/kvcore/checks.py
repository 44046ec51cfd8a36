"""Argument checks shared by kvcore value types, references and method packages (public API).

Every check raises ``ValueError`` or ``TypeError`` naming the argument and what is allowed, so bad input
never turns into NaN or a silently wrong shape further down the pipeline.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, x: object, *, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Return ``x`` if it is a tensor with the expected rank, else raise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if x.ndim not in allowed:
            raise ValueError(f"{name} must have rank {' or '.join(map(str, allowed))}, got shape {tuple(x.shape)}")
    return x


def check_float(name: str, x: torch.Tensor) -> torch.Tensor:
    """Require a floating dtype kvcore supports (fp32, fp16, bf16)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    return x


def check_finite(name: str, x: torch.Tensor) -> torch.Tensor:
    """Reject NaN and +-inf."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite (found NaN or inf)")
    return x


def check_bool_mask(name: str, mask: object, shape: tuple[int, ...]) -> torch.Tensor:
    """Return a bool mask broadcast to ``shape``."""
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}")
    try:
        return mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to {shape}") from None


def check_ratio(name: str, ratio: object) -> float:
    """A compression ratio: fraction removed, in [0, 1)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(ratio).__name__}")
    ratio = float(ratio)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (fraction removed), got {ratio}")
    return ratio
