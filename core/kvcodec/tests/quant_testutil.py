"""Helpers shared by the quantization tests (independent of the code under test)."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of ``dtype`` at ``|x|`` as float64 (subnormal spacing below the normal range)."""
    info = torch.finfo(dtype)
    a = x.double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - MANTISSA[dtype])


def make_data(seed: int, shape: tuple[int, ...], kind: int, dtype: torch.dtype) -> torch.Tensor:
    """Tensors of varied difficulty: normal, large offset with a tiny spread, integer-valued, constant rows,
    heavy-tailed, and values near zero."""
    gen = torch.Generator().manual_seed(seed)
    if kind == 0:
        x = torch.randn(shape, generator=gen) * 2
    elif kind == 1:
        x = 30 + torch.randn(shape, generator=gen) * 1e-2
    elif kind == 2:
        x = torch.randint(-4, 5, shape, generator=gen).float()
    elif kind == 3:
        x = torch.randn(shape[:-1] + (1,), generator=gen).expand(shape).clone()
    elif kind == 4:
        x = torch.randn(shape, generator=gen) ** 3 * 10
    else:
        x = torch.randn(shape, generator=gen) * 1e-3
    return x.to(dtype)


def group_view(x: torch.Tensor, axis: str, G: int) -> list[tuple[tuple, torch.Tensor]]:
    """Groups of a ``[M, T, D]`` tensor as ``((m, t_or_group, d_or_group), elements)``, by plain loops."""
    M, T, D = x.shape
    out = []
    for m in range(M):
        if axis == "token":
            for t in range(T):
                for g in range(0, D, G):
                    out.append(((m, t, g // G), x[m, t, g : g + G]))
        else:
            for g in range(0, T, G):
                for d in range(D):
                    out.append(((m, g // G, d), x[m, g : g + G, d]))
    return out
