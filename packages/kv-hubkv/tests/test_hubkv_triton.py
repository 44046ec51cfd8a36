"""Fused Triton kernel == PyTorch reference (docs/architecture.md, "Kernels").

On CPU machines ``conftest.py`` sets ``TRITON_INTERPRET=1`` before ``kv_hubkv`` is imported, so
the launcher runs in Triton's interpreter on CPU tensors; on CUDA machines it runs compiled.
Shapes stay small and every launch uses few programs (one per leading index, one block per row
unless a test asks for several blocks).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_hubkv import HubKVConfig, refine_torch
from kv_hubkv import triton_kernel as tk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# Symptoms of TRITON_INTERPRET having been set too late on a CPU machine (after `import triton`).
_LATE_INTERPRET = ("outside of the scope of a kernel", "active drivers")


def _kernel_probe() -> str | None:
    """``None`` if the kernel can run here, else why not. Only environment problems skip: any other
    error is left to the tests, which then fail."""
    if not tk.HAS_TRITON:
        return "triton is not installed"
    if DEVICE == "cuda":
        return None
    try:
        tk.refine_triton(torch.ones(1, 1, 2), 0.5)
    except Exception as e:
        if any(m in str(e) for m in _LATE_INTERPRET):
            return (
                f"Triton's CPU interpreter is not active (TRITON_INTERPRET="
                f"{os.environ.get('TRITON_INTERPRET')!r} must be set before triton is first imported): {e}"
            )
    return None


_WHY_NOT = _kernel_probe()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


def _close(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=2e-6, atol=1e-6)


def _inputs(seed, lead, H, N, plateau, prot_style, dtype):
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, H, N)
    s = torch.randint(0, 3, shape, generator=g).float() / 2 if plateau else torch.rand(shape, generator=g) * 2
    s = s.to(dtype).to(DEVICE)
    if prot_style == "none":
        prot = None
    elif prot_style == "shared":
        prot = torch.zeros((*lead, 1, N), dtype=torch.bool)
        prot[..., :2] = True
        prot[..., -3:] = True
    else:
        prot = torch.rand(shape, generator=g) < 0.25
    return s, (None if prot is None else prot.to(DEVICE))


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lead=st.sampled_from([(), (2,), (1, 2)]),
    H=st.integers(1, 4),
    N=st.integers(1, 96),
    plateau=st.booleans(),
    prot_style=st.sampled_from(["none", "shared", "per_head"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    ratio=st.floats(0.0, 0.99),
    kernel_size=st.sampled_from([1, 3, 5, 7]),
    tau=st.sampled_from([0.0, 0.5, 2.0]),
)
def test_triton_matches_reference(seed, lead, H, N, plateau, prot_style, dtype, ratio, kernel_size, tau):
    s, prot = _inputs(seed, lead, H, N, plateau, prot_style, dtype)
    cfg = HubKVConfig(kernel_size=kernel_size, tau=tau)
    _close(tk.refine_triton_config(s, ratio, prot, cfg), refine_torch(s, ratio, prot, **cfg.as_kwargs()))


@pytest.mark.parametrize("block_n", [16, 32])
def test_triton_several_blocks_per_row(block_n):
    # exercises the Chan merge across blocks and hub windows that straddle block edges
    s, prot = _inputs(7, (2,), 3, 150, True, "shared", torch.float32)
    cfg = HubKVConfig(kernel_size=7)
    _close(tk.refine_triton_config(s, 0.9, prot, cfg, block_n=block_n), refine_torch(s, 0.9, prot, kernel_size=7))


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    H=st.integers(1, 3),
    N=st.integers(1, 70),
    plateau=st.booleans(),
    prot_style=st.sampled_from(["none", "shared", "per_head"]),
    kernel_size=st.sampled_from([1, 3, 5]),
    block_n=st.sampled_from([4, 8, 16]),
)
def test_quad_mixing_equals_shifted_reloads(seed, H, N, plateau, prot_style, kernel_size, block_n):
    """Invariant: the quad path (neighbours from registers and 2-entry halos) writes exactly what the shifted
    reloads write, with hub windows straddling quads and chunks, tails shorter than a quad, and protection."""
    s, prot = _inputs(seed, (2,), H, N, plateau, prot_style, torch.float32)
    cfg = HubKVConfig(kernel_size=kernel_size)
    quads = tk.refine_triton_config(s, 0.9, prot, cfg, block_n=block_n, quad_path=True)
    shifted = tk.refine_triton_config(s, 0.9, prot, cfg, block_n=block_n, quad_path=False)
    assert torch.equal(quads, shifted)
    _close(quads, refine_torch(s, 0.9, prot, **cfg.as_kwargs()))


def test_quad_path_refuses_what_it_cannot_take():
    s = torch.rand(1, 2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="quad_path=True needs kernel_size <= 5"):
        tk.refine_triton_config(s, 0.5, None, HubKVConfig(kernel_size=7), quad_path=True)
    with pytest.raises(TypeError, match="quad_path must be None, True or False"):
        tk.refine_triton_config(s, 0.5, None, HubKVConfig(), quad_path="yes")


def test_triton_plateau_and_ceiling_above_one():
    # scores up to 1 with hubs at s = 1 -> some z > 1 -> protected tokens get nextafter(max z)
    s = torch.tensor([[[1.0, 1.0, 0.2, 1.0, 0.5, 0.5, 0.1, 0.9], [0.3, 0.3, 0.3, 0.3, 0.9, 0.0, 0.0, 0.7]]])
    s = s.to(DEVICE)
    prot = torch.zeros(1, 1, 8, dtype=torch.bool, device=DEVICE)
    prot[..., 0] = True
    out = tk.refine_triton(s, 0.95, prot)
    ref = refine_torch(s, 0.95, prot)
    _close(out, ref)
    assert torch.equal(out, ref) or float((out - ref).abs().max()) < 1e-6
    assert float(out[..., 0].min()) > float(out[..., 1:].max())


def test_triton_all_protected_and_constant_rows():
    s = torch.full((2, 3, 10), 0.25, device=DEVICE)
    prot = torch.ones(2, 3, 10, dtype=torch.bool, device=DEVICE)
    _close(tk.refine_triton(s, 0.5, prot), refine_torch(s, 0.5, prot))
    _close(tk.refine_triton(s, 0.5), refine_torch(s, 0.5))


def test_triton_non_contiguous_input():
    g = torch.Generator().manual_seed(5)
    base = torch.rand(3, 2, 40, generator=g).to(DEVICE)
    s = base.transpose(0, 1)
    _close(tk.refine_triton(s, 0.8), refine_torch(s, 0.8))


def test_triton_rejects_bad_inputs_like_the_reference():
    s = torch.rand(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="ratio"):
        tk.refine_triton(s, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        tk.refine_triton(s, 0.5, gamma=1.0)
    with pytest.raises(ValueError, match="finite"):
        tk.refine_triton(torch.tensor([[0.1, float("nan")]], device=DEVICE), 0.5)
    with pytest.raises(ValueError, match="block_n"):
        tk.refine_triton_config(s, 0.5, None, HubKVConfig(), block_n=24)


@pytest.mark.parametrize("mshape", [(30,), (4, 1), (2, 1, 1, 30)])
def test_triton_broadcast_masks(mshape):
    g = torch.Generator().manual_seed(8)
    s = torch.rand(2, 3, 4, 30, generator=g).to(DEVICE)
    prot = (torch.rand(mshape, generator=g) < 0.4).to(DEVICE)
    _close(tk.refine_triton(s, 0.9, prot), refine_torch(s, 0.9, prot))


def test_triton_rejects_negative_unprotected_and_inf_like_the_reference():
    s = torch.tensor([[[0.2, -0.1, 0.3, 0.4]]], device=DEVICE)
    with pytest.raises(ValueError, match=">= 0"):
        tk.refine_triton(s, 0.5)
    prot = torch.tensor([False, True, False, False], device=DEVICE)
    _close(tk.refine_triton(s, 0.5, prot), refine_torch(s, 0.5, prot))  # negative but protected: allowed
    with pytest.raises(ValueError, match="finite"):
        tk.refine_triton(torch.tensor([[[0.1, float("inf")]]], device=DEVICE), 0.5, prot[:2])


# -- hot path: two launches, reused scratch, deferred checks, CUDA-graph guard ------------------------------------
class _CountingKernel:
    """Wraps the jit kernel and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_triton_two_launches_per_call_and_reused_workspace(monkeypatch):
    stats, mix = _CountingKernel(tk._hubkv_stats_kernel), _CountingKernel(tk._hubkv_mix_kernel)
    monkeypatch.setattr(tk, "_hubkv_stats_kernel", stats)
    monkeypatch.setattr(tk, "_hubkv_mix_kernel", mix)
    s, prot = _inputs(3, (2, 3), 4, 37, False, "per_head", torch.float32)
    ws = tk.RefineWorkspace()
    first = tk.refine_triton_config(s, 0.7, prot, HubKVConfig(), workspace=ws, block_n=16)
    ptrs = [t.data_ptr() for t in ws.buffers(6, s.device)]
    out = torch.empty_like(first)
    again = tk.refine_triton_config(s, 0.7, prot, HubKVConfig(), workspace=ws, block_n=16, out=out)
    assert stats.launches == 2 and mix.launches == 2 and again is out
    assert [t.data_ptr() for t in ws.buffers(6, s.device)] == ptrs  # the same scratch, counter reset by the kernel
    rowcount, counter, _, zmax = ws.buffers(6, s.device)
    assert int(counter.item()) == 0 and int(rowcount.abs().sum()) == 0  # counters reset for the next call
    assert int(zmax.item()) == tk.NEG_INF_KEY  # the call's maximum reset to -inf too
    _close(first, refine_torch(s, 0.7, prot))
    _close(again, first)


@pytest.mark.parametrize("block_n", [4, 8, 64])
def test_triton_ceiling_across_chunks_rows_and_calls(block_n):
    """Scores above 1 (SnapKV-style sums over a window): the protected score P = next float above the call's
    largest refined score, found across every row and chunk, equals the reference; a second call with smaller
    scores on the same workspace gets its own P (the maximum does not leak between calls)."""
    s, prot = _inputs(9, (2, 3), 4, 37, False, "per_head", torch.float32)
    ws = tk.RefineWorkspace()
    big = s * 7.0
    _close(
        tk.refine_triton_config(big, 0.6, prot, HubKVConfig(), workspace=ws, block_n=block_n),
        refine_torch(big, 0.6, prot),
    )
    small = s * 0.5
    _close(
        tk.refine_triton_config(small, 0.6, prot, HubKVConfig(), workspace=ws, block_n=block_n),
        refine_torch(small, 0.6, prot),
    )


def test_triton_deferred_check_raises_later_and_clears():
    ws = tk.RefineWorkspace()
    bad = torch.tensor([[[0.1, float("nan"), 0.3]]], device=DEVICE)
    neg = torch.tensor([[[0.1, -0.2, 0.3]]], device=DEVICE)
    good = torch.tensor([[[0.1, 0.2, 0.3]]], device=DEVICE)
    tk.refine_triton_config(bad, 0.5, None, HubKVConfig(), workspace=ws, check="deferred")  # no raise here
    tk.refine_triton_config(good, 0.5, None, HubKVConfig(), workspace=ws, check="deferred")
    with pytest.raises(ValueError, match="finite"):
        ws.raise_if_error()
    ws.raise_if_error()  # cleared
    tk.refine_triton_config(neg, 0.5, None, HubKVConfig(), workspace=ws, check="deferred")
    with pytest.raises(ValueError, match=">= 0"):
        ws.raise_if_error()
    with pytest.raises(ValueError, match="finite"):  # eager: raised by the call, flag cleared
        tk.refine_triton_config(bad, 0.5, None, HubKVConfig(), workspace=ws)
    assert ws.error_code() == 0
    with pytest.raises(ValueError, match="check"):
        tk.refine_triton_config(good, 0.5, None, HubKVConfig(), check="later")
    with pytest.raises(ValueError, match="out must be"):
        tk.refine_triton_config(good, 0.5, None, HubKVConfig(), out=torch.empty(3, device=DEVICE))


def test_refiner_matches_refine_and_guards_cuda_graphs():
    from kv_hubkv import Refiner

    s, prot = _inputs(5, (3,), 2, 29, False, "shared", torch.float32)
    r = Refiner(check="deferred")
    _close(r(s, 0.9, prot), refine_torch(s, 0.9, prot))
    r.raise_if_error()
    with pytest.raises(ValueError, match="check"):
        Refiner(check="never")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA device"):
            Refiner(check="deferred", cuda_graph=True)
    else:
        with pytest.raises(ValueError, match="deferred"):
            Refiner(cuda_graph=True)
        g = Refiner(check="deferred", cuda_graph=True)
        with pytest.raises(ValueError, match="CUDA tensors"):
            g(s.cpu(), 0.9, prot.cpu())
        for seed in (5, 6):  # the second call replays the graph captured by the first, with new inputs
            s2, p2 = _inputs(seed, (3,), 2, 29, False, "shared", torch.float32)
            _close(g(s2, 0.9, p2).clone(), refine_torch(s2, 0.9, p2))
        g.raise_if_error()
