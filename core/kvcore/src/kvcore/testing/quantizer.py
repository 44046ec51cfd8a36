"""``QuantizerTests``: min-max error ≤ scale/2, ``quantize(dequantize(q))`` keeps the codes, exact
``nbytes``, dense bit packing (checked by an unpacker written here from the ``QuantizedTensor`` layout), shape and
dtype round trip, clear errors. Parametrize the fixture over the widths and axes you support, e.g.
``@pytest.fixture(params=[2, 4])`` returning ``MyQuantizer(bits=request.param, axis="channel", group_size=8)``.

Fixture ``quantizer``. Flags: ``uniform`` (``zero + code * scale`` with min-max rounding, so the error bound applies;
default True, False for codebooks), ``divisible_only`` (the grouped length must be a multiple of ``group_size``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

from kvcore.quantized import QuantizedTensor, packed_width
from kvcore.testing.base import StandardTests, forall, reachable_bytes
from kvcore.testing.strategies import KINDS, SEEDS, dtypes, fill


def unpack_codes(codes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """uint8 ``[..., ceil(d*bits/8)]`` -> int64 ``[..., d]``: code ``j`` is bits ``j*bits ..`` of the row's
    little-endian bit stream (stream bit ``i`` = bit ``i % 8`` of byte ``i // 8``)."""
    stream = ((codes.long()[..., None] >> torch.arange(8)) & 1).flatten(-2)[..., : d * bits]
    return (stream.unflatten(-1, (d, bits)) << torch.arange(bits)).sum(-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_codes`; unused high bits of the last byte are zero."""
    stream = ((codes.long()[..., None] >> torch.arange(bits)) & 1).flatten(-2)
    stream = torch.nn.functional.pad(stream, (0, packed_width(codes.shape[-1], bits) * 8 - stream.shape[-1]))
    return (stream.unflatten(-1, (-1, 8)) << torch.arange(8)).sum(-1).to(torch.uint8)


def per_element(q: QuantizedTensor, t: torch.Tensor | None) -> torch.Tensor | None:
    """Group metadata (``scales``, ``zeros``) expanded to the full ``[..., T, D]``."""
    dim = -1 if q.axis == "token" else -2
    return None if t is None else t.float().repeat_interleave(q.group_size, dim)[..., : q.shape[-2], : q.shape[-1]]


def reconstruct(q: QuantizedTensor, codes: torch.Tensor) -> torch.Tensor:
    """``zero + level(code) * scale`` in float32, per the documented layout."""
    level = codes.float() if q.codebook is None else q.codebook.float()[codes]
    return level * per_element(q, q.scales) + (0.0 if q.zeros is None else per_element(q, q.zeros))


class QuantizerTests(StandardTests):
    """Standard tests for a ``kvcore.Quantizer``."""

    uniform: bool = True
    divisible_only: bool = False

    @pytest.fixture
    def quantizer(self):
        raise NotImplementedError("override the `quantizer` fixture: return the Quantizer under test")

    def inputs(self, quantizer, kinds=KINDS) -> st.SearchStrategy[torch.Tensor]:
        """``[..., T, D]`` tensors of rank 2 to 4 in any float dtype."""
        G, by_token = quantizer.group_size, quantizer.axis == "token"

        @st.composite
        def draw(draw):
            lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
            T, D = draw(st.integers(1, 48)), draw(st.sampled_from((4, 8, 16, 32, 64)))
            if self.divisible_only and by_token:
                D = G * draw(st.integers(1, max(1, 64 // G)))
            elif self.divisible_only:
                T = G * draw(st.integers(1, max(1, 48 // G)))
            return fill((*lead, T, D), draw(dtypes()), draw(st.sampled_from(kinds)), draw(SEEDS))

        return draw()

    def test_roundtrip_shapes_and_metadata(self, quantizer) -> None:
        """``quantize`` returns a ``QuantizedTensor`` with the input's shape and dtype, the quantizer's ``bits`` /
        ``axis`` / ``group_size``, group metadata of the documented shape, and ``dequantize`` restores a finite tensor
        of the same shape and dtype.

        Troubleshooting: scales/zeros must be ``[..., T, ceil(D/G)]`` for ``axis="token"`` and
        ``[..., ceil(T/G), D]`` for ``axis="channel"`` (a last partial group is allowed); store the input dtype and
        cast back in ``dequantize``."""

        def check(x):
            q, (*lead, T, D), G = quantizer.quantize(x), x.shape, quantizer.group_size
            assert isinstance(q, QuantizedTensor), f"quantize() must return a QuantizedTensor, got {type(q).__name__}"
            assert (q.shape, q.dtype) == (tuple(x.shape), x.dtype)
            assert (q.bits, q.axis, q.group_size) == (quantizer.bits, quantizer.axis, G)
            groups = (*lead, T, -(-D // G)) if q.axis == "token" else (*lead, -(-T // G), D)
            assert tuple(q.scales.shape) == groups and (q.zeros is None or tuple(q.zeros.shape) == groups)
            y = quantizer.dequantize(q)
            assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())

        forall(self.inputs(quantizer), check)

    def test_error_within_half_scale(self, quantizer) -> None:
        """Uniform min-max quantization: every element is within half a step (``scale / 2``) of its input.

        Troubleshooting: round to nearest (not floor), compute scales as ``(max - min) / (2**bits - 1)`` per group in
        float32, and clamp codes to ``[0, 2**bits - 1]``; a codebook quantizer sets ``uniform = False``."""
        self.require(self.uniform, "uniform=False (codebooks have no min-max bound)")

        def check(x):
            q, fi = quantizer.quantize(x), torch.finfo(x.dtype)
            y, xf, scale = quantizer.dequantize(q).float(), x.float(), per_element(q, q.scales)
            slack = fi.eps * (xf.abs() + y.abs() + fi.tiny) + 2.0**q.bits * torch.finfo(q.scales.dtype).eps * scale
            over = (y - xf).abs() - scale / 2 - slack
            assert bool((over <= 0).all()), f"error exceeds scale/2 by {float(over.max())}"

        forall(self.inputs(quantizer), check)

    def test_requantize_gives_identical_codes(self, quantizer) -> None:
        """``quantize(dequantize(q))`` gives the same codes (quantization is idempotent).

        Troubleshooting: the group min/max must be reproduced exactly by dequantization (code 0 maps to ``zero``,
        the top code to ``max``); rounding scales to the input dtype before computing codes usually breaks this."""

        def check(x):
            q = quantizer.quantize(x)
            assert torch.equal(quantizer.quantize(quantizer.dequantize(q)).codes, q.codes), "requantizing changed codes"

        forall(self.inputs(quantizer), check)

    def test_nbytes_exact(self, quantizer) -> None:
        """``QuantizedTensor.nbytes`` counts codes + scales + zeros (+ codebook) exactly, and none of them is a
        view into a larger buffer.

        Troubleshooting: ``.clone()`` / ``.contiguous()`` slices of padded or shared buffers before returning them, so
        the storage held equals the bytes counted."""

        def check(x):
            q = quantizer.quantize(x)
            parts = (q.codes, q.scales, q.zeros, q.codebook)
            assert q.nbytes == sum(t.numel() * t.element_size() for t in parts if t is not None)
            assert q.nbytes == reachable_bytes(q), "codes/scales/zeros must not be views into larger buffers"

        forall(self.inputs(quantizer), check)

    def test_packing_bijection(self, quantizer) -> None:
        """Codes are densely packed little-endian (code ``j`` at stream bits ``j*bits ..``, stream bit ``i`` = bit
        ``i % 8`` of byte ``i // 8``) and ``dequantize`` reads any code pattern per that layout.

        Troubleshooting: use :func:`kvcore.testing.pack_codes` / ``unpack_codes`` as the reference layout; a
        big-endian bit order or one code per byte fails here even if the round trip through your own pair works."""

        def check(args):
            (x, seed), fi = args, torch.finfo(args[0].dtype)
            q = quantizer.quantize(x)
            codes = unpack_codes(q.codes, q.bits, x.shape[-1])
            assert torch.equal(pack_codes(codes, q.bits), q.codes), "codes are not densely packed"
            r = torch.randint(2**q.bits, tuple(x.shape), generator=torch.Generator().manual_seed(seed))
            for c, qq in ((codes, q), (r, dataclasses.replace(q, codes=pack_codes(r, q.bits)))):
                ref, y = reconstruct(qq, c), quantizer.dequantize(qq).float()
                tol = 4 * fi.eps * (ref.abs() + per_element(qq, qq.scales) * 2.0**q.bits + fi.tiny)
                assert bool(((y - ref).abs() <= tol).all()), "dequantize() disagrees with the documented code layout"

        forall(st.tuples(self.inputs(quantizer, ("normal", "plateau")), SEEDS), check)

    def test_rejects_bad_input(self, quantizer) -> None:
        """Rank-1, integer, NaN, inf and non-tensor inputs raise ``ValueError``/``TypeError``.

        Troubleshooting: validate with :mod:`kvcore.checks` (``check_tensor``, ``check_float``, ``check_finite``) at the
        top of ``quantize``; NaN/inf would otherwise turn every scale of the group into NaN."""
        x = torch.randn(2, 16, 16)
        nan, inf = x.masked_fill(x > 1, float("nan")), x.masked_fill(x < -1, float("-inf"))
        for what, bad in {"rank 1": x[0, 0], "int32": x.int(), "NaN": nan, "inf": inf, "a list": x.tolist()}.items():
            with pytest.raises((ValueError, TypeError)):
                quantizer.quantize(bad)
                pytest.fail(f"quantize() accepted {what} input")
