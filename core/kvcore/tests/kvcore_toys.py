"""Toy protocol objects that exercise the suites where kvcore ships no reference (scorers with queries or
extras, a min-max quantizer, a tiered quantized store). Test helpers only."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvcore import (
    FULL,
    Budget,
    Compressor,
    DenseStore,
    KVView,
    Plan,
    QuantizedTensor,
    Scores,
    Store,
    TopKSelector,
    merge_attention,
    packed_width,
    registry,
    storage_bytes,
)
from kvcore.attention import check_query, check_scale
from kvcore.checks import check_batch_index, check_finite, check_int, check_positions


class KeyNorm:
    """The scorer of ``test_toy_method.py``: low key norm = keep (Devoto et al. 2024)."""

    needs_queries, needs_values, needs_extras, query_window = False, False, frozenset(), None
    chunkable = False

    def score(self, ctx):
        return Scores(-ctx.keys.float().norm(dim=-1))


class WindowAttention:
    """SnapKV-like: attention of the query window, averaged over the GQA group and the window."""

    needs_queries, needs_values, needs_extras, query_window = True, False, frozenset(), None
    chunkable = False

    def score(self, ctx):
        if ctx.queries is None:
            raise ValueError("WindowAttention needs ctx.queries [B, Hq, W, D]")
        _B, H, _T, D = ctx.keys.shape
        q = ctx.queries.float().unflatten(1, (H, -1))  # [B, H, g, W, D]
        logits = q @ ctx.keys.float()[:, :, None].transpose(-1, -2) / math.sqrt(D)
        logits = logits.masked_fill(~ctx.valid[:, None, None, None, :], float("-inf"))
        return Scores(logits.softmax(-1).mean((2, 3)))


class Surprisal:
    """Scores every head's entries by a per-token extra, ``ctx.extras["surprisal"]`` ``[B, T]``."""

    needs_queries, needs_values, needs_extras, query_window = False, False, frozenset({"surprisal"}), None
    chunkable = False

    def score(self, ctx):
        s = ctx.extras.get("surprisal")
        if not isinstance(s, torch.Tensor):
            raise ValueError("Surprisal needs ctx.extras['surprisal'], a [B, T] float tensor")
        return Scores(s.float()[:, None, :].expand(ctx.keys.shape[:3]).contiguous())


def surprisal_extras(shapes):
    g = torch.Generator().manual_seed(shapes["seed"])
    return {"surprisal": torch.rand(shapes["B"], shapes["T"], generator=g)}


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit-pack ``[..., D]`` codes code by code (independent of the suite's packer)."""
    D = codes.shape[-1]
    out = torch.zeros(*codes.shape[:-1], packed_width(D, bits), dtype=torch.int64)
    for j in range(D):
        byte, shift = divmod(j * bits, 8)
        out[..., byte] |= (codes[..., j] << shift) & 0xFF
        if shift + bits > 8:
            out[..., byte + 1] |= codes[..., j] >> (8 - shift)
    return out.to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, D: int) -> torch.Tensor:
    wide = torch.nn.functional.pad(packed.long(), (0, 1))
    j = torch.arange(D)
    byte, shift = j * bits // 8, j * bits % 8
    return ((wide[..., byte] | (wide[..., byte + 1] << 8)) >> shift) & (2**bits - 1)


@dataclass(frozen=True)
class MinMax:
    """Uniform asymmetric min-max quantizer (KIVI §3) with explicit grouping."""

    bits: int = 4
    axis: str = "token"
    group_size: int = 8

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"x must be a float tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}")
        if x.ndim < 2 or not bool(torch.isfinite(x).all()):
            raise ValueError("x must be a finite [..., T, D] tensor")
        xf = x.float() if self.axis == "token" else x.float().transpose(-1, -2)
        n, G = xf.shape[-1], self.group_size
        pad = -n % G
        lo = torch.nn.functional.pad(xf, (0, pad), value=float("inf")).unflatten(-1, (-1, G)).amin(-1)
        hi = torch.nn.functional.pad(xf, (0, pad), value=float("-inf")).unflatten(-1, (-1, G)).amax(-1)
        scale = (hi - lo) / (2**self.bits - 1)
        s, z = scale.repeat_interleave(G, -1)[..., :n], lo.repeat_interleave(G, -1)[..., :n]
        codes = torch.where(s > 0, torch.round((xf - z) / torch.where(s > 0, s, 1)), 0)
        codes = codes.clamp(0, 2**self.bits - 1).long()
        if self.axis == "channel":
            codes, scale, lo = (t.transpose(-1, -2).contiguous() for t in (codes, scale, lo))
        return QuantizedTensor(_pack(codes, self.bits), scale, lo, self.bits, self.axis, G, tuple(x.shape), x.dtype)

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        *_, T, D = q.shape
        dim = -1 if q.axis == "token" else -2
        s = q.scales.repeat_interleave(q.group_size, dim)[..., :T, :D]
        z = q.zeros.repeat_interleave(q.group_size, dim)[..., :T, :D]
        return (z + _unpack(q.codes, q.bits, D).float() * s).to(q.dtype)


def _rows(x, m: torch.Tensor):
    """Rows ``m`` of a ``[n, D]`` tensor or token-axis QuantizedTensor (a copy, so dropped rows are freed)."""
    if isinstance(x, torch.Tensor):
        return x[m]
    shape = (int(m.sum()), x.shape[1])
    return dataclasses.replace(x, codes=x.codes[m], scales=x.scales[m], zeros=x.zeros[m], shape=shape)


def _width(x) -> int:
    """Tier of a held chunk part: ``FULL`` for a tensor, the code width for a QuantizedTensor."""
    return FULL if isinstance(x, torch.Tensor) else x.bits


def _transcode(x, bits: int):
    """``x`` (a ``[n, D]`` tensor or token-axis min-max codes) at ``bits`` <= its width, from what is held.

    Equal width: ``x`` itself. Full precision to a width: min-max quantization. Codes of width ``w`` to a lower
    width ``b``: codes rescaled by ``(2**b - 1) / (2**w - 1)`` (rounded half up, in integers) and scales by the
    inverse, zeros unchanged, so the new codes span the same group range; the error against the held values is at
    most half a new step."""
    if bits == _width(x):
        return x
    if isinstance(x, torch.Tensor):
        return MinMax(bits, "token", 4).quantize(x)
    hi_old, hi_new = 2**x.bits - 1, 2**bits - 1
    codes = _unpack(x.codes, x.bits, x.shape[-1])
    new = (2 * codes * hi_new + hi_old) // (2 * hi_old)
    return dataclasses.replace(x, codes=_pack(new, bits), scales=x.scales * (hi_old / hi_new), bits=bits)


class ToyTieredStore(Store):
    """Per-head chunks at full precision or 2/4-bit token-axis min-max codes; re-tiers with demotion (codes
    transcoded 4 -> 2 bits) and attends chunk by chunk, merging the partial attentions by their log-sum-exp."""

    supported_bits = frozenset({0, 2, 4, 16})
    can_demote = True
    can_attend = True

    def __init__(self) -> None:
        self.reset()

    def _head_tiers(self, chunks):
        """``(positions, key tiers, value tiers)`` of one head in position order (the order of ``read``)."""
        if not chunks:
            return torch.zeros(0, dtype=torch.long), *[torch.zeros(0, dtype=torch.uint8)] * 2
        pos = torch.cat([c[0] for c in chunks])
        kt = torch.cat([torch.full((len(c[0]),), _width(c[1]), dtype=torch.uint8) for c in chunks])
        vt = torch.cat([torch.full((len(c[0]),), _width(c[2]), dtype=torch.uint8) for c in chunks])
        order = pos.argsort()
        return pos[order], kt[order], vt[order]

    def tiers(self):
        if self.heads is None:
            raise ValueError("tiers() on an empty store")
        B, H, _ = self.shape
        heads = [self._head_tiers(c) for c in self.heads]
        T = max(len(p) for p, _, _ in heads)
        kb, vb = torch.zeros(B * H, T, dtype=torch.uint8), torch.zeros(B * H, T, dtype=torch.uint8)
        for i, (p, kt, vt) in enumerate(heads):
            kb[i, : len(p)], vb[i, : len(p)] = kt, vt
        return Plan(kb.view(B, H, T), vb.view(B, H, T))

    def retier(self, plan):
        held = self.tiers()  # raises on an empty store
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a kvcore.Plan, got {type(plan).__name__}")
        if plan.key_bits.shape != held.key_bits.shape:
            raise ValueError(f"plan must be laid out like read(): {tuple(held.key_bits.shape)}")
        for name, new, old in (
            ("key", plan.key_bits, held.key_bits),
            ("value", plan.bits_for_values, held.bits_for_values),
        ):
            if set(new.unique().tolist()) - self.supported_bits:
                raise ValueError(f"{name} tiers must be in {sorted(self.supported_bits)}")
            if bool(((new != 0) & (old == 0)).any()):
                raise ValueError(f"plan keeps {name} padding (read() position -1): padding must be EVICT")
            if bool((new > old).any()):
                raise ValueError(f"plan moves {name} entries up; retier only evicts or demotes")
        if not torch.equal(plan.keep_keys, plan.keep_values):
            raise ValueError("keys and values must keep the same entries")
        H = self.shape[1]
        heads = []
        for i, chunks in enumerate(self.heads):
            b, h = divmod(i, H)
            order = self._head_tiers(chunks)[0]
            new_chunks = []
            for p, k, v in chunks:
                at = torch.searchsorted(order, p)
                nk, nv = plan.key_bits[b, h][at], plan.bits_for_values[b, h][at]
                for wk, wv in sorted(set(zip(nk.tolist(), nv.tolist())) - {(0, 0)}):
                    m = (nk == wk) & (nv == wv)
                    new_chunks.append((p[m], _transcode(_rows(k, m), wk), _transcode(_rows(v, m), wv)))
            heads.append(new_chunks)
        self.heads = heads

    def attend(self, query, scale=None):
        if self.heads is None:
            raise ValueError("attend() on an empty store")
        B, H, D = self.shape
        q = check_query(query, H, D, B).float()
        scale = check_scale(scale, D)
        g = q.shape[1] // H
        out = torch.zeros(q.shape)
        lse = torch.full(q.shape[:3], float("-inf"))
        for i, chunks in enumerate(self.heads):
            b, h = divmod(i, H)
            parts = []
            for _, k, v in (c for c in chunks if len(c[0])):
                k, v = (x if isinstance(x, torch.Tensor) else MinMax(x.bits, "token", 4).dequantize(x) for x in (k, v))
                logits = q[b, h * g : (h + 1) * g] @ k.float().T * scale
                parts.append((logits.softmax(-1) @ v.float(), logits.logsumexp(-1)))
            if parts:
                out[b, h * g : (h + 1) * g], lse[b, h * g : (h + 1) * g] = merge_attention(parts)
        return out, lse

    def reset(self) -> None:
        self.heads: list[list[tuple]] | None = None  # per (b, h): chunks (positions, keys, values)
        self.shape = (0, 0, 0)

    def _check(self, keys, values, held: bool):
        if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)) or not keys.is_floating_point():
            raise TypeError("keys and values must be float tensors")
        if keys.ndim != 4 or values.shape != keys.shape or values.dtype != keys.dtype:
            raise ValueError("keys and values must be matching [B, H, T, D] tensors")
        if (
            held
            and self.heads is not None
            and ((*keys.shape[:2], keys.shape[-1]) != self.shape or keys.dtype != self.dtype)
        ):
            raise ValueError(f"entries must match the stored [B, H, *, D] = {self.shape} of {self.dtype}")

    def _last(self):
        """``[B]`` the last position held per batch row (``-1``: none)."""
        B, H, _ = self.shape
        last = [max((int(c[0].max()) for c in chunks if len(c[0])), default=-1) for chunks in self.heads]
        return torch.tensor(last).view(B, H).amax(-1)

    def write(self, keys, values, plan, positions):
        self._check(keys, values, held=False)
        B, H, T, D = keys.shape
        if not isinstance(plan, Plan) or plan.key_bits.shape != (B, H, T) or plan.tiers() - self.supported_bits:
            raise ValueError(f"plan must be [B, H, T] over tiers {sorted(self.supported_bits)}")
        if not torch.equal(plan.keep_keys, plan.keep_values):
            raise ValueError("keys and values must keep the same entries")
        positions = check_positions("positions", positions, (B, T), keep=plan.keep_keys)
        check_finite("keys (kept entries)", keys[plan.keep_keys])
        check_finite("values (kept entries)", values[plan.keep_keys])
        heads = []
        for b in range(B):
            for h in range(H):
                chunks, kb, vb = [], plan.key_bits[b, h], plan.bits_for_values[b, h]
                for wk, wv in set(zip(kb.tolist(), vb.tolist())) - {(0, 0)}:
                    m = (kb == wk) & (vb == wv)
                    k, v = keys[b, h][m], values[b, h][m]
                    k = k if wk == 16 else MinMax(wk, "token", 4).quantize(k)
                    v = v if wv == 16 else MinMax(wv, "token", 4).quantize(v)
                    chunks.append((positions[b][m], k, v))
                heads.append(chunks)
        self.heads, self.shape, self.dtype = heads, (B, H, D), keys.dtype

    def append(self, keys, values, positions):
        self._check(keys, values, held=True)
        B, H, n, _ = keys.shape
        if self.heads is None:
            return self.write(keys, values, Plan.from_keep(torch.ones(B, H, n, dtype=torch.bool)), positions)
        positions = check_positions("positions", positions, (B, n), after=self._last())
        check_finite("keys", keys)
        check_finite("values", values)
        for i, chunks in enumerate(self.heads):
            b, h = divmod(i, self.shape[1])
            chunks.append((positions[b].clone(), keys[b, h].clone(), values[b, h].clone()))

    def _head(self, chunks):
        if not chunks:
            return torch.zeros(0, dtype=torch.long), *[torch.zeros(0, self.shape[2], dtype=self.dtype)] * 2
        pos = torch.cat([c[0] for c in chunks])
        order = pos.argsort()
        deq = [
            [x if isinstance(x, torch.Tensor) else MinMax(x.bits, "token", 4).dequantize(x) for x in c[1:]]
            for c in chunks
        ]
        return pos[order], torch.cat([k for k, _ in deq])[order], torch.cat([v for _, v in deq])[order]

    def read(self, query=None):
        if self.heads is None:
            raise ValueError("read() on an empty store")
        B, H, D = self.shape
        heads = [self._head(c) for c in self.heads]
        T = max(len(p) for p, _, _ in heads)
        pos = torch.full((B * H, T), -1)
        k, v = torch.zeros(B * H, T, D, dtype=self.dtype), torch.zeros(B * H, T, D, dtype=self.dtype)
        for i, (p, kk, vv) in enumerate(heads):
            pos[i, : len(p)], k[i, : len(p)], v[i, : len(p)] = p, kk, vv
        bias = torch.zeros(B * H, T).masked_fill(pos < 0, float("-inf"))
        return KVView(k.view(B, H, T, D), v.view(B, H, T, D), pos.view(B, H, T), bias.view(B, H, T))

    def nbytes(self, device=None):
        parts = [
            t
            for chunks in self.heads or []
            for c in chunks
            for x in c
            for t in ((x,) if isinstance(x, torch.Tensor) else (x.codes, x.scales, x.zeros))
        ]
        return storage_bytes(parts, device)

    def seq_lengths(self):
        B, H, _ = self.shape
        lengths = [sum(len(c[0]) for c in chunks) for chunks in self.heads or []]
        return torch.tensor(lengths, dtype=torch.long).view(B, H)

    def crop(self, position):
        check_int("position", position)
        for chunks in self.heads or []:
            chunks[:] = [tuple(_rows(x, c[0] < position) for x in c) for c in chunks]

    def reorder(self, index):
        B, H, D = self.shape
        index = check_batch_index("index", index, B)
        self.heads = [list(self.heads[int(i) * H + h]) for i in index for h in range(H)]
        self.shape = (len(index), H, D)


def _keynorm(budget):
    return Compressor(KeyNorm(), TopKSelector(), DenseStore, budget, name="keynorm")


TOY_METHODS = (
    registry.Method("keynorm", _keynorm, "keep low-norm keys (Devoto et al. 2024)"),
    registry.Method("keynorm-layer", _keynorm, "the same, per layer", default=Budget(0.5, granularity="layer")),
)
"""A method table as a package registers it under the ``kvcompress.methods`` entry-point group."""
