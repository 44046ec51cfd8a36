"""Triton surprisal kernel (SEKV §3.1, Eq. 1) == the PyTorch reference and the full log-softmax under
TRITON_INTERPRET=1 (compiled on a GPU). Small shapes and blocks of 16: the interpreter runs every program in Python."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

import kv_sekv.surprisal as surprisal_mod
from kv_sekv.kernels import triton_surprisal
from kv_sekv.kernels.triton_surprisal import HAS_TRITON, surprisal_triton
from kv_sekv.surprisal import surprisal_from_hidden, surprisal_from_logits
from kvcore.surprisal import token_surprisal

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

SMALL = {"block_t": 16, "block_v": 16, "block_k": 16}


def _case(B, T, D, V, *, bias=True, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(B, T, D, generator=g)).to(dtype).to(DEVICE)
    weight = torch.randn(V, D, generator=g).to(dtype).to(DEVICE)
    b = (3 * torch.randn(V, generator=g)).to(dtype).to(DEVICE) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    return hidden, weight, b, ids


def _full(hidden, weight, b, ids):
    logits = hidden.float() @ weight.float().T + (0 if b is None else b.float())
    return surprisal_from_logits(logits, ids)


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("B", "T", "D", "V", "bias", "dtype"),
    [
        (2, 5, 20, 37, True, torch.float32),  # d_model and V not multiples of 16
        (1, 7, 16, 50, False, torch.float32),  # no bias
        (2, 4, 24, 40, True, torch.bfloat16),
        (1, 6, 16, 33, False, torch.bfloat16),
    ],
)
def test_kernel_equals_reference(B, T, D, V, bias, dtype):
    """Surprisal from the kernel = the chunked PyTorch reference = −log_softmax of the full logits; position 0 is 0."""
    assert HAS_TRITON
    hidden, weight, b, ids = _case(B, T, D, V, bias=bias, dtype=dtype, seed=V)
    got = surprisal_triton(hidden, weight, ids, b, **SMALL)
    assert got.dtype == torch.float32 and got.shape == (B, T)
    _close(got, token_surprisal(hidden, weight, ids, b, chunk=7))
    _close(got, _full(hidden, weight, b, ids))
    assert bool((got[:, 0] == 0).all())


@pytest.mark.parametrize("chunks_per_split", [1, 2, 8, None])
def test_any_vocabulary_split_matches_reference(chunks_per_split):
    """V = 70 in chunks of 16 over 5, 3 (the last clipped at V), 1 and the default number of splits, large logits
    (the online max matters), every split holding targets; strided hidden states and a transposed weight view."""
    hidden, weight, b, ids = _case(2, 9, 20, 70, scale=10.0, seed=1)
    ids[0, 1:] = torch.arange(0, 70, 9)[:8].to(DEVICE)  # targets spread over the vocabulary
    hidden_view = torch.zeros(2, 9, 32, device=DEVICE)[..., 4:24]
    hidden_view.copy_(hidden)
    weight_view = weight.T.contiguous().T  # [V, D] with strides (1, V)
    got = surprisal_triton(hidden_view, weight_view, ids, b, chunks_per_split=chunks_per_split, **SMALL)
    _close(got, token_surprisal(hidden, weight, ids, b))
    _close(got, _full(hidden, weight, b, ids))
    assert float(got.max()) > 10  # large logits: a naive softmax would not see these


def test_left_padding_and_first_real_token_are_zero():
    """Left padding via attention_mask: the padding and the first real token of a row are 0, the rest as unmasked."""
    hidden, weight, b, ids = _case(3, 6, 20, 37, seed=2)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], device=DEVICE)
    got = surprisal_triton(hidden, weight, ids, b, mask, **SMALL)
    _close(got, token_surprisal(hidden, weight, ids, b, mask))
    full = surprisal_triton(hidden, weight, ids, b, **SMALL)
    assert got[1, :3].tolist() == [0.0, 0.0, 0.0] and got[2].tolist() == [0.0] * 6
    assert bool((full[1, :3] != 0).any())  # the mask did the zeroing
    assert torch.equal(got[0], full[0]) and torch.equal(got[1, 3:], full[1, 3:])


@pytest.mark.parametrize("T", [1, 2])
def test_shortest_sequences(T):
    """T = 1: nothing is predicted (all 0); T = 2: one predicting position per row (a tile mostly empty)."""
    hidden, weight, b, ids = _case(3, T, 16, 21, seed=T)
    got = surprisal_triton(hidden, weight, ids, b, **SMALL)
    assert got.shape == (3, T)
    _close(got, token_surprisal(hidden, weight, ids, b))
    _close(got, _full(hidden, weight, b, ids))
    assert bool((got[:, 0] == 0).all()) and (T == 1 or bool((got[:, 1] > 0).all()))


def test_surprisal_from_hidden_dispatches_after_its_checks(monkeypatch):
    """With the Triton path chosen (forced on CPU), surprisal_from_hidden runs the kernel on checked input and
    raises the PyTorch path's errors on bad input before the kernel is reached; bad block sizes are refused."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return surprisal_triton(*args, **kwargs)

    monkeypatch.setattr(surprisal_mod.dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(triton_surprisal, "surprisal_triton", spy)
    hidden, weight, b, ids = _case(1, 4, 8, 20, seed=4)
    mask = torch.tensor([[0, 1, 1, 1]], device=DEVICE)
    got = surprisal_from_hidden(hidden, weight, ids, b, mask)
    assert calls == [1]
    _close(got, token_surprisal(hidden, weight, ids, b, mask))
    bad = [
        (ValueError, "weight", (hidden, torch.randn(20, 5, device=DEVICE), ids)),
        (ValueError, "input_ids", (hidden, weight, ids + 20)),
        (ValueError, "input_ids", (hidden, weight, ids[:, :3])),
        (TypeError, "input_ids", (hidden, weight, ids.float())),
        (ValueError, "bias", (hidden, weight, ids, b[:5])),
        (ValueError, "attention_mask", (hidden, weight, ids, b, mask[:, :3])),
    ]
    for err, match, args in bad:
        for use in (True, False):
            monkeypatch.setattr(surprisal_mod.dispatch, "use_triton", lambda t, use=use: use)
            with pytest.raises(err, match=match):
                surprisal_from_hidden(*args)
    with pytest.raises(ValueError, match="chunk"):
        surprisal_from_hidden(hidden, weight, ids, chunk=0)
    assert calls == [1]
    with pytest.raises(ValueError, match="block_v"):
        surprisal_triton(hidden, weight, ids, block_v=24)
    with pytest.raises(ValueError, match="chunks_per_split"):
        surprisal_triton(hidden, weight, ids, chunks_per_split=0)
