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
theory                       F_sub, marginal gains, greedy oracle, Prop. 3 bounds (Appendix J)
diagnostics                  Appendix I diagnostics on captured scores

``theory`` and ``diagnostics`` are analysis tools, not on the inference path: they are imported on first
attribute access (``kv_hubkv.theory``), so ``import kv_hubkv`` stays cheap.
"""

import importlib
from types import ModuleType

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
    "diagnostics",
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
    "theory",
]

_LAZY_SUBMODULES = ("diagnostics", "theory")


def __getattr__(name: str) -> ModuleType:
    """Import the analysis submodules (``theory``, ``diagnostics``) on first access (PEP 562)."""
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
