"""kv_hubkv — HubKV score refinement (Submodular Marginal Discounting) on any kvcore Scorer.

Paper: *HubKV: Efficient KV Cache Compression via Submodular Marginal Discounting* (§3.3).

Main entry points
-----------------
refine, refine_config        the refinement (Triton on CUDA, PyTorch reference on CPU)
refine_torch, refine_triton  the two back ends with the same signature
Refiner, RefineWorkspace     the hot-path form: reused scratch, deferred value checks, optional CUDA graphs
HubKVConfig                  validated hyper-parameters (paper defaults)
HubKV, hubkv                 kvcore Scorer wrapper / ready-made Compressor around a base method
DecodingSchedule             decoding-stage re-compression parameters (§4.3, App. A.1)
local_hubs, head_weights     building blocks (Eqs. 6 and 8–9)

The analysis tools (F_sub, greedy oracle, Prop. 3 bounds; Appendix I diagnostics) are not on the inference path and
live in kv-lab: ``kv_lab.hubkv.theory`` and ``kv_lab.hubkv.diagnostics``.
"""

from .ceiling import retention_ceiling
from .compressor import hubkv
from .config import HubKVConfig
from .decoding import DecodingSchedule
from .hubs import local_hubs, smd_discount
from .reference import refine_torch
from .refine import refine, refine_config
from .refiner import Refiner
from .scorer import HubKV
from .selectivity import head_statistics, head_weights
from .triton_kernel import HAS_TRITON, refine_triton
from .workspace import RefineWorkspace

__all__ = [
    "HAS_TRITON",
    "DecodingSchedule",
    "HubKV",
    "HubKVConfig",
    "RefineWorkspace",
    "Refiner",
    "head_statistics",
    "head_weights",
    "hubkv",
    "local_hubs",
    "refine",
    "refine_config",
    "refine_torch",
    "refine_triton",
    "retention_ceiling",
    "smd_discount",
]
