"""KIVI's decode-time layout of a :class:`~kv_baselines.quant.KIVIStore`: strided buffers written in place.

While a KIVI cache decodes (Liu et al. 2024, "KIVI", §3.3-3.4, Algorithm 1) every head holds the same entries: a
quantized key part that grows by one block of ``R`` tokens every ``R`` steps, a key residual of fewer than ``R``
rows, a quantized value part that grows by one token per step and a full value FIFO of ``R`` rows. The flat,
segment-major layout of :mod:`kv_baselines.quant.kivi_layout` has to copy every segment to append one entry to each;
:class:`DecodeState` instead holds each part as a ``[S, capacity, ...]`` buffer with a bounded reserve past the
entries held, so a decode step writes its entries in place:

* packed codes are held *token-inner*, ``uint8 [S, P, capacity]`` (byte ``p`` of token ``t`` holds channels
  ``p * L .. p * L + L - 1``, ``L = 8 // bits``, kvcodec's little-endian lanes), so one broadcast ``and`` over
  ``[S, P, L, T]`` isolates every lane with ``T`` contiguous (vectorised; a row-major unpack broadcasts over only
  ``L`` lanes) and yields the transposed cache ``[S, D, T]`` the attention matmuls read directly;
* key scales/zeros ``[S, D, groups]``, value scales/zeros ``[S, D / G, capacity]``;
* the value FIFO is a ring of exactly ``R`` rows: each step quantizes the oldest row and writes the new one into
  its slot (attention is order-free, the attention weights are rotated to match);
* positions are shared by the heads of a batch row: ``[B, capacity]``.

**Reserve (counted in** ``nbytes()`` **: it is memory the store holds).** Value codes, scales and zeros and the
positions grow with :func:`reserve` slots (``max(16, n // 128)``), the key residual with ``KEY_RESERVE`` rows; the
quantized keys grow by exactly one block every ``R`` steps (no reserve). At SmolLM2's shape (3 KV heads, d 64,
fp32, 2k tokens, 2-bit) this keeps the held bytes within 3% of the theoretical packed size, positions included.

Attention (:meth:`DecodeState.attend`) unpacks each side into one per-thread scratch buffer shared by every store
(working memory, like a full cache's attention temporaries; not held by a store, so not in ``nbytes()``), dequantizes
the keys' codes in place by their scales (their zeros enter the logits once per group, ``q·z``) and folds the value
scales and zeros into the attention weights per group:
``p·(s·c + z) = (p·s)·c + p·z`` (per token ``t`` and channel group), so the unpacked value codes are read once, by
one batched matmul. Mutations are all-or-nothing: everything that can fail runs before the first write that
:meth:`to_flat` or :meth:`attend` could see.
"""

from __future__ import annotations

import functools

import torch

from kv_baselines.quant.kivi_layout import Positions, Side, uniform
from kv_baselines.quant.token_quant import quantize_tokens
from kvcodec import UniformQuantizer
from kvcodec.kernels.dispatch import use_triton
from kvcodec.narrow import narrow_int
from kvcodec.scratch import scratch
from kvcore.checks import MAX_POSITION, values_checked

KEY_RESERVE = 8
"""Key residual rows reserved past the rows held."""

FOLDED_DECODE = False
"""Whether :meth:`DecodeState.attend` takes kvcodec's decode attention v2 (the folded formulation, issue 43) on CUDA
where it applies: off until its speed is measured on a device; an explicit opt-in (set this, or pass ``folded``)."""


def reserve(n: int) -> int:
    """Slots reserved past ``n`` entries when a per-token buffer grows: ``max(16, n // 128)``."""
    return max(16, n // 128)


@functools.cache
def _lane_masks(bits: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[1, 1, L, 1]``: the bits of every code lane of a byte (``L = 8 // bits``, little-endian lanes)."""
    per = 8 // bits
    return (((1 << bits) - 1) << (torch.arange(per, device=device) * bits)).to(torch.uint8).view(1, 1, per, 1)


@functools.cache
def lane_scale(bits: int, D: int, device: torch.device) -> torch.Tensor:
    """float32 ``[D]``: ``2 ** -(bits * lane)`` of every channel, undoing the lane offsets :func:`unpack_tokens`
    leaves in its codes."""
    per = 8 // bits
    return torch.exp2(-(bits * (torch.arange(D, device=device) % per)).float())


def unpack_tokens(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """float32 ``[S, P * L, n]`` *lane-shifted* codes ``code * 2 ** (bits * lane)`` of the first ``n`` tokens of
    token-inner packed bytes ``uint8 [S, P, capacity]`` (``L = 8 // bits`` lanes, channel ``p * L + lane``): one
    masking ``and`` over every lane and one conversion, into per-thread scratch. The shift of each lane is left in
    the code and undone by :func:`lane_scale` on the (small) scales or outputs, which saves a pass over the codes."""
    S, P, _ = packed.shape
    L = 8 // bits
    dev = packed.device
    lanes = scratch("lanes", S * P * L * n, torch.uint8, dev).view(S, P, L, n)
    torch.bitwise_and(packed[:, :, None, :n], _lane_masks(bits, dev), out=lanes)
    out = scratch("codes", S * P * L * n, torch.float32, dev).view(S, P * L, n)
    out.copy_(lanes.view(S, P * L, n))
    return out


ALIGN = 16
"""Token-inner buffers (codes, parameters) hold a multiple of this many slots per row, so every row starts 16-element
aligned and the decode kernel reads them in vectors."""


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def _grow(
    buf: torch.Tensor, used: int, need: int, extra: int, dim: int = -1, dtype: torch.dtype | None = None,
    align: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``buf`` if its capacity (size along ``dim``) holds ``need`` slots, else a new buffer of ``need + extra`` slots
    (rounded up to a multiple of :data:`ALIGN` where ``align``) with the first ``used`` copied (cast to ``dtype``)."""
    dtype = buf.dtype if dtype is None else dtype
    if need <= buf.shape[dim] and dtype == buf.dtype:
        return buf
    shape = list(buf.shape)
    shape[dim] = aligned(need + extra) if align else need + extra
    out = torch.empty(shape, dtype=dtype, device=buf.device)
    out.narrow(dim, 0, used).copy_(buf.narrow(dim, 0, used))
    return out


def _tokens_inner(codes: torch.Tensor, S: int, n: int) -> torch.Tensor:
    """uint8 ``[S, P, n]`` token-inner bytes of packed rows ``uint8 [S * n, P]`` (segment-major)."""
    return codes.view(S, n, codes.shape[-1]).transpose(1, 2)


def eligible(sides: dict[str, Side], pos: Positions, B: int, H: int, residual: int) -> bool:
    """Whether a flat state can be held as a :class:`DecodeState`: :class:`kvcodec.UniformQuantizer` sides (float32,
    float16 or bfloat16, any device) of 1/2/4/8 bits with whole bytes of codes per row, per-channel keys in whole
    groups, per-token values in whole channel groups, no permanent full-precision entries, every head holding the
    same entries (positions shared by the heads of a row) and quantized entries on both sides."""
    ks, vs = sides["k"], sides["v"]
    if B * H == 0:
        return False
    for side, axis in ((ks, "channel"), (vs, "token")):
        q = side.quantizer
        if not (
            isinstance(q, UniformQuantizer)
            and q.axis == axis
            and 8 % q.bits == 0
            and side.D % (8 // q.bits) == 0
            and side.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and side.meta is not None
            and side.codebook is None
            and side.zeros is not None
        ):
            return False
    if ks.D % vs.quantizer.group_size or ks.unit != ks.quantizer.group_size:
        return False
    if bool(ks.fcount.any()) or bool(vs.fcount.any()):
        return False
    counts = [pos.count, ks.qcount, ks.rcount, vs.qcount, vs.rcount]
    if not all(uniform(c) for c in counts):
        return False
    if int(vs.rcount[0]) > residual or ks.scales.shape[0] * ks.unit != ks.codes.shape[0]:
        return False
    T = int(pos.count[0])
    p = pos.pos.view(B, H, T)
    return bool((p == p[:, :1]).all()) if H > 1 and T else True


class DecodeState:
    """One KIVI layer's cache in the decode layout (module docstring); built from and turned back into the flat
    :class:`~kv_baselines.quant.kivi_layout.Side` pair by :meth:`of` / :meth:`to_flat` (bit-exact both ways)."""

    def __init__(self) -> None:  # filled by :meth:`of`
        self.B = self.H = self.D = self.R = 0

    # -- conversion ------------------------------------------------------------------------------------
    @classmethod
    def of(cls, sides: dict[str, Side], pos: Positions, B: int, H: int, residual: int) -> DecodeState:
        """The decode layout of an :func:`eligible` flat state (new tensors; the flat state is not changed)."""
        ks, vs = sides["k"], sides["v"]
        S, D, R = B * H, ks.D, residual
        st = cls()
        st.B, st.H, st.D, st.R = B, H, D, R
        # what the flat sides are built with again (no tensor of theirs is kept: nbytes() counts what is reachable)
        st.kinfo = (ks.quantizer, ks.unit, ks.dtype, ks.meta)
        st.vinfo = (vs.quantizer, vs.unit, vs.dtype, vs.meta)
        dev = ks.codes.device
        st.tk, st.nr = ks.codes.shape[0] // S, int(ks.rcount[0])
        st.tv = vs.codes.shape[0] // S
        G = ks.unit
        nG = st.tk // G
        st.kc = torch.empty(S, ks.codes.shape[1], aligned(st.tk), dtype=torch.uint8, device=dev)
        st.kc[:, :, : st.tk] = _tokens_inner(ks.codes, S, st.tk)
        st.ks = ks.scales.view(S, nG, D).transpose(1, 2).contiguous()
        st.kz = ks.zeros.view(S, nG, D).transpose(1, 2).contiguous()
        st.kr = torch.empty(S, min(R, st.nr + KEY_RESERVE), D, dtype=ks.dtype, device=dev)
        st.kr[:, : st.nr] = ks.resid.view(S, st.nr, D)
        cap = aligned(st.tv + reserve(st.tv))
        C = vs.scales.shape[-1]
        st.vc = torch.empty(S, vs.codes.shape[1], cap, dtype=torch.uint8, device=dev)
        st.vc[:, :, : st.tv] = _tokens_inner(vs.codes, S, st.tv)
        st.vs = torch.empty(S, C, cap, dtype=vs.scales.dtype, device=dev)
        st.vs[:, :, : st.tv] = vs.scales.view(S, st.tv, C).transpose(1, 2)
        st.vz = torch.empty(S, C, cap, dtype=vs.zeros.dtype, device=dev)
        st.vz[:, :, : st.tv] = vs.zeros.view(S, st.tv, C).transpose(1, 2)
        st.nv = int(vs.rcount[0])
        st.ring = torch.empty(S, min(R, st.nv + KEY_RESERVE), D, dtype=vs.dtype, device=dev)
        st.ring[:, : st.nv] = vs.resid.view(S, st.nv, D)
        st.head = 0  # the slot of the oldest row (the ring turns only once it holds R rows)
        T = st.tk + st.nr
        st.top = pos.top
        st.pos = torch.empty(B, T + reserve(T), dtype=pos.pos.dtype, device=dev)
        st.pos[:, :T] = pos.pos.view(B, H, T)[:, 0]
        return st

    @property
    def length(self) -> int:
        """Entries held per head."""
        return self.tk + self.nr

    def to_flat(self) -> tuple[dict[str, Side], Positions]:
        """The flat state holding the same entries (bit-exact codes, parameters and rows; no reserve)."""
        B, H, D = self.B, self.H, self.D
        S, T = B * H, self.length
        dev = self.kc.device
        kq, ku, kdt, kmeta = self.kinfo
        vq, vu, vdt, vmeta = self.vinfo
        nG = self.tk // ku

        # contiguous copies (with S = 1 a reshape of the transposed buffer is a strided view of it)
        def rows(packed: torch.Tensor, n: int) -> torch.Tensor:
            return packed[:, :, :n].transpose(1, 2).reshape(S * n, packed.shape[1]).contiguous()

        def params(t: torch.Tensor, n: int) -> torch.Tensor:
            return t[:, :, :n].transpose(1, 2).reshape(S * n, 1, t.shape[1]).contiguous()

        def full(n: int) -> torch.Tensor:
            return torch.full((S,), n, dtype=torch.long, device=dev)

        def side(q, unit, dtype, meta, codes, scales, zeros, usize, units, quantized, resid, r) -> Side:
            return Side(
                quantizer=q,
                unit=unit,
                D=D,
                dtype=dtype,
                codes=codes,
                scales=scales,
                zeros=zeros,
                codebook=None,
                usize=usize,
                ucount=full(units),
                qcount=full(quantized),
                full=torch.zeros(0, D, dtype=dtype, device=dev),
                fcount=full(0),
                full_mask=None,
                resid=resid,
                rcount=full(r),
                meta=meta,
            )

        k = side(
            kq,
            ku,
            kdt,
            kmeta,
            rows(self.kc, self.tk),
            params(self.ks, nG),
            params(self.kz, nG),
            torch.full((S * nG,), ku, dtype=torch.int16, device=dev),
            nG,
            self.tk,
            self.kr[:, : self.nr].reshape(S * self.nr, D).clone(),  # (a view of kr would keep its reserve)
            self.nr,
        )
        v = side(
            vq,
            vu,
            vdt,
            vmeta,
            rows(self.vc, self.tv),
            params(self.vs, self.tv),
            params(self.vz, self.tv),
            None,
            self.tv,
            self.tv,
            self.ring[:, : self.nv].roll(-self.head, 1).reshape(S * self.nv, D).clone(),
            self.nv,
        )
        p = self.pos[:, None, :T].expand(B, H, T).reshape(-1).to(narrow_int(self.top)).clone()
        return {"k": k, "v": v}, Positions(full(T), p, self.top)

    def counts(self) -> dict[str, int]:
        """Entries per head: quantized and residual, per side."""
        return {"kq": self.tk, "kr": self.nr, "vq": self.tv, "vr": self.nv}

    # -- decode ----------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``[B, H, n, D]`` validated entries at validated ``positions [B, n]`` (KIVI's residual policy, see
        :class:`~kv_baselines.quant.KIVIStore`). All-or-nothing: every quantization and allocation runs first.

        Where :func:`kvcore.checks.values_checked` is off (accelerators by default) nothing is read on the host:
        the positions are held in int32 (no search for the narrowest dtype) and a value group whose range
        overflows its scale dtype (a spread beyond the dtype's largest value, such as ±3e38 in float32) is not
        detected, as non-finite input is not."""
        checked = values_checked(keys)
        B, H, n, D = keys.shape
        S, R = B * H, self.R
        k_new, v_new = keys.reshape(S, n, D), values.reshape(S, n, D)
        # keys: the residual grows to R, then whole blocks of R are quantized per channel
        nr, f = self.nr + n, (self.nr + n) // R
        kc, ks, kz, kr = self.kc, self.ks, self.kz, self.kr
        if f:
            block = torch.cat([kr[:, : self.nr], k_new], 1)
            kq, G = self.kinfo[0], self.kinfo[1]
            q = kq.quantize(block[:, : f * R].reshape(-1, G, D))
            nG, g0 = f * R // G, self.tk // G
            kc = _grow(kc, self.tk, self.tk + f * R, 0, align=True)
            ks = _grow(ks, g0, g0 + nG, 0)
            kz = _grow(kz, g0, g0 + nG, 0)
            left = block[:, f * R :]
            nr = left.shape[1]
            kr = torch.empty(S, min(R, nr + KEY_RESERVE), D, dtype=kr.dtype, device=kr.device)
            kr[:, :nr] = left
        else:
            kr = _grow(kr, self.nr, nr, min(KEY_RESERVE, R - nr), dim=1)
        # values: a FIFO of R; the oldest rows past R leave it, quantized per token
        nv, out = self.nv, max(0, self.nv + n - R)
        ring, head = self.ring, self.head
        if out == 0:  # the FIFO is not full yet (head = 0): rows are added after the held ones
            ring = _grow(ring, nv, nv + n, min(KEY_RESERVE, R - nv - n), dim=1)
        elif n == 1 and nv == R:  # the decode step: the oldest row leaves, the new one takes its slot
            old = ring[:, head]
        else:
            seq = torch.cat([ring[:, :nv].roll(-head, 1), v_new], 1)
            old = seq[:, :out]
        if out:
            vq = self.vinfo[0]
            codes, scales, zeros = quantize_tokens(old.reshape(S * out, D), vq.bits, vq.group_size)
            if checked and not bool(torch.isfinite(scales).all()):
                raise ValueError(
                    f"x has a group range (max - min) too large for {scales.dtype} scales at bits={vq.bits}; "
                    "quantize it in float32"
                )
        tv, C = self.tv, self.vs.shape[1]
        extra = reserve(tv + out)
        vc = _grow(self.vc, tv, tv + out, extra, align=True)
        vs = _grow(self.vs, tv, tv + out, extra, align=True)
        vz = _grow(self.vz, tv, tv + out, extra, align=True)
        T = self.length
        if checked:  # the positions' dtype is the narrowest that holds the largest one
            top = max(self.top, int(positions[:, -1].max()))
            pdtype = narrow_int(top)
        else:  # not read (a host sync on a GPU): int32 holds every position a store takes (kvcore MAX_POSITION)
            top = MAX_POSITION
            pdtype = torch.promote_types(self.pos.dtype, torch.int32)
        pos = _grow(self.pos, T, T + n, reserve(T + n), dtype=pdtype)
        # -- writes (into reserve slots, invisible until the counts below change), then the commit ------------
        if f:
            kc[:, :, self.tk : self.tk + f * R] = _tokens_inner(q.codes.reshape(S * f * R, -1), S, f * R)
            ks[:, :, g0 : g0 + nG] = q.scales.view(S, nG, D).transpose(1, 2)
            kz[:, :, g0 : g0 + nG] = q.zeros.view(S, nG, D).transpose(1, 2)
        else:
            kr[:, self.nr : nr] = k_new
        if out:
            vc[:, :, tv : tv + out] = _tokens_inner(codes, S, out)
            vs[:, :, tv : tv + out] = scales.view(S, out, C).transpose(1, 2)
            vz[:, :, tv : tv + out] = zeros.view(S, out, C).transpose(1, 2)
        pos[:, T : T + n] = positions.to(pos.dtype)
        if out == 0:
            ring[:, nv : nv + n] = v_new
        elif n == 1 and nv == R:
            ring[:, head : head + 1] = v_new  # a slice: no index copied to the device
            head = (head + 1) % R
        else:
            ring, head = seq[:, out:].clone(), 0
        self.kc, self.ks, self.kz, self.kr, self.vc, self.vs, self.vz, self.pos = kc, ks, kz, kr, vc, vs, vz, pos
        self.ring, self.head, self.nv = ring, head, nv + n - out
        self.tk, self.nr, self.tv, self.top = self.tk + f * R, nr, tv + out, top

    def attend(
        self, query: torch.Tensor, scale: float, folded: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out float32 [S, M, D], lse float32 [S, M, 1])`` of ``query [S, M, D]`` (the ``M`` query rows of each
        KV head): the Triton kernel (:mod:`kv_baselines.quant.kivi_decode_triton`) for CUDA caches of the shapes
        it takes (power-of-two head dims and value groups), else :func:`decode_attention_ref`.

        ``folded`` (default :data:`FOLDED_DECODE`, off): on CUDA, for the shapes it takes, kvcodec's decode attention
        v2 instead (:func:`kvcodec.decode_v2.kivi_decode_v2`, the folded formulation: within ``docs/protocols.md``'s
        tolerance of attention over ``read()``, not bit-exact); elsewhere the paths above."""
        if (FOLDED_DECODE if folded is None else folded) and use_triton(self.kc):
            from kvcodec.decode_v2 import PackedKIVI
            from kvcodec.kernels import triton_decode_v2 as v2

            cache = PackedKIVI.of_state(self)
            if v2.supported(cache):
                return v2.kivi_decode_v2_triton(query, cache, scale)
        if use_triton(self.kc):
            from kv_baselines.quant import kivi_decode_triton as kernel

            if kernel.supported(self):
                return kernel.decode_attention_triton(self, query, scale)
        return decode_attention_ref(self, query, scale)


def decode_attention_ref(state: DecodeState, query: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out float32 [S, M, D], lse float32 [S, M, 1])`` of ``query [S, M, D]`` over ``state``, from the codes
    (module docstring): PyTorch, any device; the reference of the Triton kernel, same signature.

    The softmax is left unnormalised (``e = exp(logits - max)``) and the small output is divided by ``sum(e)``
    instead of the weights. Dequantized entries are not rounded to the cache dtype (``read()`` rounds them)."""
    qf = query.float()
    S, M, D = qf.shape
    tk, nr, tv = state.tk, state.nr, state.tv
    G = state.kinfo[1]
    qs = qf * scale
    parts = []
    if tk:
        bits = state.kinfo[0].bits
        k = unpack_tokens(state.kc, tk, bits)  # [S, D, tk], lane-shifted codes
        nG = tk // G
        k.view(S, D, nG, G).mul_((state.ks[:, :, :nG] * lane_scale(bits, D, k.device)[:, None])[..., None])
        lk = torch.bmm(qs, k)  # q·(s·c), then + q·z once per group (not added to every code)
        lk.view(S, M, nG, G).add_(torch.bmm(qs, state.kz[:, :, :nG].float())[..., None])
        parts.append(lk)
    if nr:
        parts.append(torch.bmm(qs, state.kr[:, :nr].transpose(1, 2).float()))
    logits = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    m = logits.amax(-1, keepdim=True)
    e = logits.sub_(m).exp_()
    total = e.sum(-1, keepdim=True)
    er = e[..., tv:]
    out = torch.bmm(er.roll(state.head, -1) if state.head else er, state.ring[:, : state.nv].float())
    if tv:
        C = state.vs.shape[1]
        Gv = D // C
        v = unpack_tokens(state.vc, tv, state.vinfo[0].bits)  # [S, D, tv] = [S, C, Gv, tv], lane-shifted
        eq = e[..., :tv]
        ew = eq[:, None] * state.vs[:, :, None, :tv]  # [S, C, M, tv]
        # one flat batch of S * C matmuls (a 4-D broadcast matmul runs several times slower on CPU)
        oc = torch.bmm(ew.view(S * C, M, tv), v.view(S * C, Gv, tv).transpose(1, 2)).view(S, C, M, Gv)
        oc.mul_(lane_scale(state.vinfo[0].bits, D, v.device).view(C, 1, Gv))
        oz = torch.bmm(eq, state.vz[:, :, :tv].transpose(1, 2).float())  # [S, M, C]
        out += (oc.transpose(1, 2) + oz[..., None]).reshape(S, M, D)
    return out.div_(total), total.log_().add_(m)
