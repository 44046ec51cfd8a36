"""``QuantizerTests``: the Quantizer contract (DESIGN.md §3) — min-max error ≤ scale/2, ``quantize(dequantize(q))``
gives the same codes, exact ``nbytes``, densely packed codes (checked by an independent bit-unpacker written
from the ``QuantizedTensor`` layout), shape/dtype round trip, clear errors.

Adopt (parametrize the fixture over the widths you support)::

    class TestMyQuantizer(QuantizerTests):
        @pytest.fixture(params=[2, 4, 8])
        def quantizer(self, request):
            return MyQuantizer(bits=request.param, axis="channel", group_size=8)

Fixture ``quantizer``. Flags: ``uniform`` (codes are ``zero + code * scale`` with min-max rounding, so the
error bound applies; default True; set False for codebooks), ``divisible_only`` (the grouped length must be a
multiple of ``group_size``; default False).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

from kvcore.quantized import QuantizedTensor, packed_width
from kvcore.testing.base import StandardTests, forall
from kvcore.testing.strategies import KINDS, SEEDS, dtypes, fill
from kvcore.testing.walk import reachable_bytes


def unpack_codes(codes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Codes ``[..., ceil(d*bits/8)]`` uint8 -> ``[..., d]`` int64: code ``j`` is bits ``j*bits ..`` of the row's
    little-endian bit stream (bit ``i`` of the stream is bit ``i % 8`` of byte ``i // 8``)."""
    stream = (codes.long()[..., None] >> torch.arange(8)) & 1
    stream = stream.flatten(-2)[..., : d * bits].unflatten(-1, (d, bits))
    return (stream << torch.arange(bits)).sum(-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_codes` (unused high bits of the last byte are zero)."""
    d = codes.shape[-1]
    stream = ((codes.long()[..., None] >> torch.arange(bits)) & 1).flatten(-2)
    stream = torch.nn.functional.pad(stream, (0, packed_width(d, bits) * 8 - d * bits)).unflatten(-1, (-1, 8))
    return (stream << torch.arange(8)).sum(-1).to(torch.uint8)


def per_element(q: QuantizedTensor, t: torch.Tensor | None) -> torch.Tensor | None:
    """Expand group metadata (``scales`` / ``zeros``) to the full ``[..., T, D]`` shape."""
    if t is None:
        return None
    *_, T, D = q.shape
    dim = -1 if q.axis == "token" else -2
    return t.float().repeat_interleave(q.group_size, dim=dim)[..., :T, :D]


def reconstruct(q: QuantizedTensor, codes: torch.Tensor) -> torch.Tensor:
    """``zero + level(code) * scale`` in float32, from the documented layout."""
    level = codes.float() if q.codebook is None else q.codebook.float()[codes]
    zero = per_element(q, q.zeros)
    return level * per_element(q, q.scales) + (0.0 if zero is None else zero)


class QuantizerTests(StandardTests):
    """Standard tests for a ``kvcore.Quantizer``."""

    uniform: bool = True
    divisible_only: bool = False

    @pytest.fixture
    def quantizer(self):
        raise NotImplementedError("override the `quantizer` fixture: return the Quantizer under test")

    def inputs(self, quantizer, kinds=KINDS) -> st.SearchStrategy[torch.Tensor]:
        """``[..., T, D]`` tensors (rank 2 to 4) of any float dtype."""
        G = quantizer.group_size

        @st.composite
        def draw_x(draw):
            lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
            T, D = draw(st.integers(1, 48)), draw(st.sampled_from((4, 8, 16, 32, 64)))
            if self.divisible_only and quantizer.axis == "token":
                D = G * draw(st.integers(1, max(1, 64 // G)))
            if self.divisible_only and quantizer.axis == "channel":
                T = G * draw(st.integers(1, max(1, 48 // G)))
            return fill((*lead, T, D), draw(dtypes()), draw(st.sampled_from(kinds)), draw(SEEDS))

        return draw_x()

    def test_roundtrip_shapes_and_metadata(self, quantizer) -> None:
        def check(x):
            q = quantizer.quantize(x)
            assert isinstance(q, QuantizedTensor), f"quantize() must return a QuantizedTensor, got {type(q).__name__}"
            assert (q.shape, q.dtype) == (tuple(x.shape), x.dtype)
            assert (q.bits, q.axis, q.group_size) == (quantizer.bits, quantizer.axis, quantizer.group_size)
            *lead, T, D = x.shape
            G = q.group_size
            groups = (*lead, T, -(-D // G)) if q.axis == "token" else (*lead, -(-T // G), D)
            assert tuple(q.scales.shape) == groups, f"scales {tuple(q.scales.shape)} != groups {groups}"
            assert q.zeros is None or tuple(q.zeros.shape) == groups
            y = quantizer.dequantize(q)
            assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())

        forall(self.inputs(quantizer), check)

    def test_error_within_half_scale(self, quantizer) -> None:
        self.require(self.uniform, "uniform=False (codebook quantizers have no min-max bound)")

        def check(x):
            q = quantizer.quantize(x)
            y, scale = quantizer.dequantize(q).float(), per_element(q, q.scales)
            xf, fi = x.float(), torch.finfo(x.dtype)
            slack = fi.eps * (xf.abs() + y.abs() + fi.tiny) + 2.0**q.bits * torch.finfo(q.scales.dtype).eps * scale
            err = (y - xf).abs() - (scale / 2 + slack)
            assert bool((err <= 0).all()), f"error exceeds scale/2 by {float(err.max())}"

        forall(self.inputs(quantizer), check)

    def test_requantize_gives_identical_codes(self, quantizer) -> None:
        def check(x):
            q = quantizer.quantize(x)
            assert torch.equal(quantizer.quantize(quantizer.dequantize(q)).codes, q.codes), "quantize(dequantize(q)) != q"

        forall(self.inputs(quantizer), check)

    def test_nbytes_exact(self, quantizer) -> None:
        def check(x):
            q = quantizer.quantize(x)
            parts = (q.codes, q.scales, q.zeros, q.codebook)
            assert q.nbytes == sum(t.numel() * t.element_size() for t in parts if t is not None)
            assert q.nbytes == reachable_bytes(q), "codes/scales/zeros must not be views into larger buffers"

        forall(self.inputs(quantizer), check)

    def test_packing_bijection(self, quantizer) -> None:
        def check(args):
            x, seed = args
            q = quantizer.quantize(x)
            codes = unpack_codes(q.codes, q.bits, x.shape[-1])
            assert int(codes.max()) < 2**q.bits and torch.equal(pack_codes(codes, q.bits), q.codes), "codes not densely packed"
            r = torch.randint(2**q.bits, tuple(x.shape), generator=torch.Generator().manual_seed(seed))
            for c, qq in ((codes, q), (r, dataclasses.replace(q, codes=pack_codes(r, q.bits)))):
                ref, y = reconstruct(qq, c), quantizer.dequantize(qq).float()
                tol = 4 * torch.finfo(x.dtype).eps * (ref.abs() + per_element(qq, qq.scales) * 2.0**q.bits + torch.finfo(x.dtype).tiny)
                assert bool(((y - ref).abs() <= tol).all()), "dequantize() disagrees with the documented code layout"

        forall(st.tuples(self.inputs(quantizer, ("normal", "plateau")), SEEDS), check)

    def test_rejects_bad_input(self, quantizer) -> None:
        x = torch.randn(2, 16, 16)
        nan, inf = x.clone(), x.clone()
        nan[0, 3, 5], inf[1, 2, 7] = float("nan"), float("-inf")
        for what, bad in {"rank 1": x[0, 0], "int32": x.to(torch.int32), "NaN": nan, "inf": inf, "list": x.tolist()}.items():
            with pytest.raises((ValueError, TypeError)):
                quantizer.quantize(bad)
                pytest.fail(f"quantize() accepted {what} input")
