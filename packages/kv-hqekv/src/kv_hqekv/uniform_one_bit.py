"""Uniform min-max 1-bit quantization held in the normalized tier's form: Table 6's "w/o II" ablation (HqeKV §4.5).

The ablation replaces HqeKV's normalized 1-bit quantizer by uniform min-max at 1 bit (App. A.9.2: "uniform
quantization to 4, 2 and 1 bit-widths based on the opt-ratio"). A 1-bit min-max code reconstructs to the group
minimum ``lo`` or maximum ``hi`` (``code = round((x - lo) / (hi - lo))``, so ``1`` exactly when ``x`` lies above the
midrange). Those two levels are the normalized tier's ``zero ± c·scale`` (``c = Φ⁻¹(3/4)``, the 1-bit codebook) with
``zero = (lo + hi) / 2`` and ``scale = (hi - lo) / (2c)``, and the normalized code ``1[x > zero]`` is the min-max
code, so the ablation changes only the group statistics: the store's 1-bit tier, its demotions and the fused
attention read these tensors unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_hqekv.normalized import NormalizedQuantizer
from kvcodec import normal_codebook
from kvcodec.stats import minmax_stats


@dataclass(frozen=True)
class UniformOneBitQuantizer(NormalizedQuantizer):
    """Uniform min-max 1-bit quantization (HqeKV Table 6, "w/o II"), a ``kvcore.Quantizer``.

    Each group reconstructs to its minimum or its maximum (within the rounding of the statistics to the input
    dtype): code ``1`` for entries above the midrange, ``0`` otherwise. Held like
    :class:`~kv_hqekv.normalized.NormalizedQuantizer` (module docstring): ``zeros`` = midrange, ``scales`` =
    half-range / ``c``, the 1-bit Gaussian-quantile codebook ``±c``. A constant group reconstructs exactly.

    Parameters
    ----------
    bits : int
        Must be 1 (the tier this ablation replaces).
    axis : {"token", "channel"}
        Grouping, as :class:`~kv_hqekv.normalized.NormalizedQuantizer`.
    group_size : int
        ``G`` (paper: 32).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits != 1:
            raise ValueError(f"bits must be 1 (UniformOneBitQuantizer is the 1-bit tier), got {self.bits!r}")

    def statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(zeros, scales)`` per group: the midrange ``(lo + hi) / 2`` and ``(hi - lo) / (2c)``."""
        st = minmax_stats(x, self.axis, self.group_size)
        c = float(normal_codebook(1)[1])
        mid = st.lo + (st.hi - st.lo) / 2  # exact for a constant group, no overflow for large opposite bounds
        return torch.where(st.lo == st.hi, st.lo, mid), (st.hi - st.lo) / (2 * c)
