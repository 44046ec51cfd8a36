"""Triton coarse entries (SEKV §3.2, Eq. 2–3) == the PyTorch reference under TRITON_INTERPRET=1 (compiled on a GPU).

Small shapes and few, large program blocks: the interpreter runs every program in Python.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from kv_sekv import segment
from kv_sekv import summaries as summaries_module
from kv_sekv.kernels import triton_summaries
from kv_sekv.kernels.triton_summaries import HAS_TRITON, coarse_entries_triton, span_layout
from kv_sekv.summaries import coarse_entries, coarse_entries_torch, span_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

TOL = dict(rtol=1e-5, atol=1e-5)


def _mixed_layout() -> tuple[torch.Tensor, torch.Tensor]:
    """``(span_id, h)``: 3 resident tokens, a 1-token span, 2 resident, a 37-token span (three chunks of 16, the
    last partial), 1 resident, a 16-token span (one full chunk), a 5-token span of zero surprisal, 4 resident."""
    parts = [(-1, 3), (0, 1), (-1, 2), (1, 37), (-1, 1), (2, 16), (3, 5), (-1, 4)]
    span_id = torch.cat([torch.full((k,), s, dtype=torch.long) for s, k in parts])
    h = torch.rand(span_id.numel(), generator=torch.Generator().manual_seed(0)) * 3
    h[span_id == 3] = 0.0
    return span_id, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("D", "block_d"), [(12, None), (20, 16)])
def test_coarse_entries_triton_equals_reference(dtype, D, block_d):
    """Resident tokens before, between and after spans, spans of 1, 16 and 37 tokens (over BLOCK_T = 16), a
    zero-surprisal span (uniform weights: its entry is the mean of its tokens), three KV heads, D not a power of two
    (one channel block, or two with the second masked), float32 and bfloat16 keys."""
    assert HAS_TRITON
    span_id, h = _mixed_layout()
    n = span_id.numel()
    x = torch.randn(3, n, D, generator=torch.Generator().manual_seed(D)).to(dtype)
    w = span_weights(h, span_id)
    want = coarse_entries_torch(x, span_id, w, 4)
    got = coarse_entries_triton(x.to(DEVICE), span_id.to(DEVICE), w.to(DEVICE), 4, block_t=16, block_d=block_d)
    assert got.dtype == torch.float32 and got.shape == (3, 4, D)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    torch.testing.assert_close(got[:, 3].cpu(), x[:, span_id == 3].float().mean(1), **TOL)


def test_spans_need_not_be_consecutive():
    """Span tokens interleaved with resident (padding) tokens and with each other, ids out of order, a span id
    without tokens (a zero row), a weight on a resident token (unused): the launcher sorts tokens by span."""
    span_id = torch.tensor([1, -1, 0, 1, -1, -1, 0, 1, 3, -1, 1, -2, 0] + [1] * 20 + [-1, 3])
    n = span_id.numel()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, n, 8, generator=g)
    w = torch.rand(n, generator=g)
    order, start, length = span_layout(span_id, 4)
    assert length.tolist() == [3, 24, 0, 2] and start.tolist() == [0, 3, 27, 27]
    assert order[:3].tolist() == [2, 6, 12] and order[27:29].tolist() == [8, 34]
    want = coarse_entries_torch(x, span_id, w, 4)
    got = coarse_entries_triton(x.to(DEVICE), span_id.to(DEVICE), w.to(DEVICE), 4, block_t=16)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    assert bool((got[:, 2] == 0).all())


def test_no_spans_and_no_tokens():
    """``n_spans = 0`` (every token resident) gives ``[Hkv, 0, D]``; no tokens at all, too; spans without tokens
    give zero rows."""
    x = torch.randn(2, 6, 5, device=DEVICE)
    sid = torch.full((6,), -1, dtype=torch.long, device=DEVICE)
    w = torch.zeros(6, device=DEVICE)
    assert coarse_entries_triton(x, sid, w, 0).shape == (2, 0, 5)
    assert bool((coarse_entries_triton(x, sid, w, 2) == 0).all())
    empty = coarse_entries_triton(x[:, :0], sid[:0], w[:0], 0)
    assert empty.shape == (2, 0, 5) and empty.dtype == torch.float32
    none = coarse_entries_triton(x[:, :0], sid[:0], w[:0], 2)
    assert none.shape == (2, 2, 5) and bool((none == 0).all())


def test_strided_views_match_the_reference():
    """Keys as a non-contiguous view (a slice of a longer buffer, channels strided) and a stride-0 expansion: the
    kernel reads through the strides."""
    g = torch.Generator().manual_seed(2)
    buf = torch.randn(2, 40, 24, generator=g)
    x = buf[:, 3:33, ::2]  # [2, 30, 12], strides (960, 24, 2)
    sid = torch.tensor([-1] * 4 + [0] * 10 + [-1] + [1] * 12 + [-1] * 3)
    w = torch.rand(30, generator=g)
    want = coarse_entries_torch(x, sid, w, 2)
    got = coarse_entries_triton(x.to(DEVICE), sid.to(DEVICE), w.to(DEVICE), 2, block_t=16)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    row = torch.randn(1, 1, 12, generator=g).expand(1, 30, 12)
    got = coarse_entries_triton(row.to(DEVICE), sid.to(DEVICE), w.to(DEVICE), 2, block_t=16)
    torch.testing.assert_close(got.cpu(), coarse_entries_torch(row, sid, w, 2), **TOL)


@settings(max_examples=15, deadline=None)
@given(st.integers(8, 48), st.sampled_from((3, 8, 12)), st.integers(1, 2), st.booleans(), st.integers(0, 999))
def test_segmentation_layouts_match_the_reference(n, D, Hkv, bf16, seed):
    """Property: on the layouts the segmentation produces (surprisal anchors, L_min = 2, a window, spans cut to
    at most 20 tokens), with half the surprisal zeroed, the kernel equals the reference."""
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(n, generator=g) * 4
    h[: n // 2] = 0.0
    span_id, _ = segment(h, 2.5, 2, 3, max_span=20)
    m = int(span_id.max()) + 1
    x = torch.randn(Hkv, n, D, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
    w = span_weights(h, span_id)
    got = coarse_entries_triton(x.to(DEVICE), span_id.to(DEVICE), w.to(DEVICE), m, block_t=16)
    torch.testing.assert_close(got.cpu(), coarse_entries_torch(x, span_id, w, m), **TOL)


def test_coarse_entries_dispatches_to_the_kernel(monkeypatch):
    """``coarse_entries`` runs the Triton launcher where ``use_triton`` says so (CUDA; forced here, the interpreter
    runs it on CPU tensors) and gives the reference's result; with autograd tracking ``x`` it takes the reference
    (the kernel has no backward)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return coarse_entries_triton(*args, **kwargs)

    monkeypatch.setattr(summaries_module.dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(triton_summaries, "coarse_entries_triton", spy)
    span_id, h = _mixed_layout()
    x = torch.randn(1, span_id.numel(), 4, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    span_id, w = span_id.to(DEVICE), span_weights(h, span_id).to(DEVICE)
    torch.testing.assert_close(coarse_entries(x, span_id, w, 4), coarse_entries_torch(x, span_id, w, 4), **TOL)
    assert len(calls) == 1
    xg = x.clone().requires_grad_(True)
    coarse_entries(xg, span_id, w, 4).sum().backward()
    assert len(calls) == 1 and xg.grad is not None


def _bad_inputs():
    n = 6
    x = torch.randn(2, n, 4)
    sid = torch.tensor([-1, 0, 0, 1, 1, -1])
    w = torch.rand(n)
    return [
        ((x[0], sid, w, 2), ValueError, "^x must have rank 3"),
        ((x.long(), sid, w, 2), TypeError, "^x must be float32"),
        (("keys", sid, w, 2), TypeError, "^x must be a torch.Tensor"),
        ((x, sid.float(), w, 2), TypeError, "^span_id must be an integer tensor"),
        ((x, sid[:5], w, 2), ValueError, r"^span_id must have shape \[n=6\]"),
        ((x, sid[None], w, 2), ValueError, "^span_id must have rank 1"),
        ((x, sid, w.double(), 2), TypeError, "^weights must be float32"),
        ((x, sid, w[:4], 2), ValueError, r"^weights must have shape \[n=6\]"),
        ((x, sid, w, -1), ValueError, r"^n_spans must be an int >= 0, got -1"),
        ((x, sid, w, 2.0), TypeError, "^n_spans must be an int"),
        ((x, sid, w, 1), ValueError, "^span_id holds span 1, but n_spans is 1"),
    ]


@pytest.mark.parametrize("triton_path", [False, True])
@pytest.mark.parametrize(("args", "error", "message"), _bad_inputs())
def test_bad_input_is_refused_naming_the_argument(monkeypatch, triton_path, args, error, message):
    """Wrong ranks, lengths and dtypes raise before dispatch, naming the argument; a span id >= ``n_spans`` is
    refused on both paths (the Triton launcher checks it with its one host read)."""
    monkeypatch.setattr(summaries_module.dispatch, "use_triton", lambda t: triton_path)
    with pytest.raises(error, match=message):
        coarse_entries(*args)


def test_bad_block_sizes_are_refused():
    """Block sizes must be powers of two >= 16."""
    x, sid, w = torch.randn(1, 4, 4), torch.zeros(4, dtype=torch.long), torch.rand(4)
    for kwargs, err in ((dict(block_t=24), ValueError), (dict(block_d=8), ValueError), (dict(block_t=True), TypeError)):
        with pytest.raises(err, match=next(iter(kwargs))):
            coarse_entries_triton(x, sid, w, 1, **kwargs)
