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


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """An ``int`` (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_number(name: str, value: object, *, low: float | None = None, high: float | None = None) -> float:
    """A finite real number (int or float, not a bool) in ``[low, high]``; returned as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_integer_tensor(name: str, x: object, *, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """An integer tensor (int8..int64, uint8) of the given rank."""
    x = check_tensor(name, x, ndim=ndim)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    return x
