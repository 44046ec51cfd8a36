"""``Refiner``: the HubKV refinement for a hot path -- reused scratch, deferred checks, optional CUDA graphs.

:func:`kv_hubkv.refine` checks the score values before returning (one host synchronisation) and allocates its
scratch per call. A serving loop that refines scores of the same shapes every step can hold a :class:`Refiner`
instead: its :class:`~kv_hubkv.workspace.RefineWorkspace` is reused across calls, ``check="deferred"`` leaves the
value checks in the workspace's error flag until :meth:`Refiner.raise_if_error` (no synchronisation per call),
and ``cuda_graph=True`` captures the single kernel launch per input signature (shape, dtype, strides of the scores
and the protected mask, ratio) in a CUDA graph replayed on later calls (paper §3.3's refinement, fused kernel of
:mod:`kv_hubkv.triton_kernel`).
"""

from __future__ import annotations

import torch

from kvcore.dispatch import use_triton

from .config import HubKVConfig
from .reference import refine_torch_config
from .triton_kernel import HAS_TRITON, refine_triton_config
from .workspace import RefineWorkspace

__all__ = ["Refiner"]


class Refiner:
    """HubKV refinement with reused scratch, an optional deferred value check and optional CUDA-graph replay.

    Parameters
    ----------
    config : HubKVConfig, optional
        Hyper-parameters (paper defaults if omitted).
    check : {"eager", "deferred"}, default "eager"
        ``"eager"``: bad score values raise ``ValueError`` from the call (one host synchronisation, the contract
        of :func:`kv_hubkv.refine`). ``"deferred"``: calls do not synchronise; bad values set an error flag that
        :meth:`raise_if_error` reads (and the returned scores are unspecified until then). CPU tensors (the
        PyTorch reference) are always checked eagerly.
    cuda_graph : bool, default False
        Capture the kernel launch per input signature in a CUDA graph (needs CUDA and triton, and
        ``check="deferred"``: a graph cannot synchronise). A call then copies its inputs into the graph's static
        buffers and replays it; the returned tensor is the graph's output buffer, overwritten by the next call with
        the same signature (clone it to keep it).

    Raises
    ------
    RuntimeError
        ``cuda_graph=True`` without a CUDA device or without triton.
    ValueError
        A bad ``check``, or ``cuda_graph=True`` with ``check="eager"``; at call time, ``cuda_graph=True`` with
        scores that are not on a CUDA device.
    """

    def __init__(self, config: HubKVConfig | None = None, *, check: str = "eager", cuda_graph: bool = False) -> None:
        config = HubKVConfig() if config is None else config
        if not isinstance(config, HubKVConfig):
            raise TypeError(f"config must be a HubKVConfig, got {type(config).__name__}")
        if check not in ("eager", "deferred"):
            raise ValueError(f"check must be 'eager' or 'deferred', got {check!r}")
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool, got {type(cuda_graph).__name__}")
        if cuda_graph:
            if not torch.cuda.is_available():
                raise RuntimeError("cuda_graph=True needs a CUDA device (CUDA graphs do not exist on CPU)")
            if not HAS_TRITON:
                raise RuntimeError("cuda_graph=True needs triton (pip install 'kv-hubkv[triton]')")
            if check != "deferred":
                raise ValueError("cuda_graph=True needs check='deferred': a captured graph cannot synchronise")
        self.config = config
        self.check = check
        self.cuda_graph = cuda_graph
        self.workspace = RefineWorkspace()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}

    def __call__(self, scores: torch.Tensor, ratio: float, protected: torch.Tensor | None = None) -> torch.Tensor:
        """Refined float32 scores of ``scores [..., H, N]`` (see :func:`kv_hubkv.refine`)."""
        if self.cuda_graph:
            return self._replay(scores, ratio, protected)
        if isinstance(scores, torch.Tensor) and use_triton(scores):
            return refine_triton_config(
                scores, ratio, protected, self.config, workspace=self.workspace, check=self.check
            )
        return refine_torch_config(scores, ratio, protected, self.config)

    def raise_if_error(self) -> None:
        """Raise the reference's ``ValueError`` if a deferred call since the last check saw bad score values."""
        self.workspace.raise_if_error()

    # -- CUDA graphs -------------------------------------------------------------------------------------
    def _replay(self, scores: torch.Tensor, ratio: float, protected: torch.Tensor | None) -> torch.Tensor:
        if not (isinstance(scores, torch.Tensor) and scores.is_cuda):
            where = scores.device if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"cuda_graph=True refines CUDA tensors only, got scores on {where}")
        key = (
            tuple(scores.shape),
            scores.stride(),
            scores.dtype,
            scores.device,
            float(ratio),
            None if protected is None else (tuple(protected.shape), protected.stride(), protected.device),
        )
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(scores, ratio, protected)
            self._graphs[key] = entry
        graph, s_in, p_in, out = entry
        s_in.copy_(scores)
        if p_in is not None:
            p_in.copy_(protected)
        graph.replay()
        return out

    def _capture(self, scores: torch.Tensor, ratio: float, protected: torch.Tensor | None):
        s_in = torch.empty_strided(scores.shape, scores.stride(), dtype=scores.dtype, device=scores.device)
        s_in.copy_(scores)
        p_in = None
        if protected is not None:
            p_in = torch.empty_strided(
                protected.shape, protected.stride(), dtype=protected.dtype, device=protected.device
            )
            p_in.copy_(protected)
        out = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)

        def launch() -> None:
            refine_triton_config(s_in, ratio, p_in, self.config, workspace=self.workspace, check="deferred", out=out)

        side = torch.cuda.Stream(device=scores.device)
        side.wait_stream(torch.cuda.current_stream(scores.device))
        with torch.cuda.stream(side):  # compile the kernel and allocate the workspace outside the capture
            launch()
        torch.cuda.current_stream(scores.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        return graph, s_in, p_in, out
