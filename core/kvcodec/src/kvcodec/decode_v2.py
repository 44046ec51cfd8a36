"""Decode attention v2 over KIVI-style packed codes: the *folded* formulation, agreeing with attention over the
dequantized cache within a stated tolerance instead of bit for bit (issue 43; contract in ``docs/protocols.md``).

A cache is described by :class:`PackedKIVI`, the buffers of KIVI's decode layout
(:class:`kv_baselines.quant.kivi_decode.DecodeState`, no conversion) as plain tensors: per head ``s``

* keys quantized per channel within groups of ``G`` tokens: token-inner codes ``kc uint8 [S, P, capacity]`` (byte
  ``p`` of token ``t`` holds channels ``p * L .. p * L + L - 1``, ``L = 8 // kbits`` little-endian lanes), scales
  and zeros ``ks, kz [S, D, groups]``; entries ``t < tk`` are quantized, ``tk <= t < tk + nr`` are the full-precision
  residual rows ``kr [S, rows, D]``;
* values quantized per token in channel groups of ``GV``: codes ``vc uint8 [S, P, capacity]``, scales and zeros
  ``vs, vz [S, D / GV, capacity]``; entries ``t < tv`` are quantized, the others are the FIFO ring ``ring [S, rows,
  D]`` (entry ``t`` in slot ``(t - tv + head) mod nv``).

The folded formulation (as the KIVI, QServe and Marlin kernels compute), for the quantized entries:

* **keys**: ``q · k_t = Σ_d (q_d s_dg) c_td + Σ_d q_d z_dg`` for ``t`` in group ``g``: the group's scales are folded
  into the query (``q ⊙ s_g``, as two float16 parts: the matrix-unit operands) and its zeros into one bias per group
  (``q · z_g``), so the inner product multiplies raw codes;
* **values**: ``Σ_t p_t v_td = Σ_t (p_t s_tc) c_td + Σ_t p_t z_tc`` for channel ``d`` in group ``c``: each token's
  scale is folded into its probability (``p ⊙ s_c``, rounded to float16) and the zeros into one correction per
  channel group and query row.

:func:`kivi_decode_v2_ref` computes exactly that in PyTorch (float32, with the two float16 roundings of the matrix
operands the kernel makes); :func:`kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton` is the Triton kernel of
the same signature; :func:`kivi_decode_v2` picks one. :func:`dequantized` gives the dense entries ``read()``-style
(``zero + code * scale`` in float32 rounded to the cache dtype), the reference the tolerance is stated against
(:data:`OUT_RTOL`, :data:`LSE_ATOL`, :func:`contract_errors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcodec.kernels.dispatch import use_triton

OUT_RTOL = 2e-3
"""Contract, output: per query row, ``‖out - out_ref‖ / ‖out_ref‖ ≤ OUT_RTOL`` against attention over the codes
dequantized in float32, and ``≤ OUT_RTOL + 2 e_out`` against attention over ``read()``'s entries, ``e_out`` the row's
error of ``read()``'s own rounding to the cache dtype (:func:`contract_errors`; ``docs/protocols.md``)."""
LSE_ATOL = 1e-3
"""Contract, log-sum-exp: per query row, ``|lse - lse_ref| ≤ LSE_ATOL`` (float32 dequantization), ``≤ LSE_ATOL +
2 e_lse`` (``read()``)."""
FLOOR = 1e-2
"""Rows whose reference output norm is below this times the RMS row norm (a near-cancelling average) are measured
against that floor instead of their own norm (:func:`row_errors`)."""


@dataclass(frozen=True)
class PackedKIVI:
    """One layer's KIVI cache in the decode layout (module docstring). Tensors are the layout's own buffers (their
    capacity may exceed the counts); ``kbits``/``vbits`` are 1, 2, 4 or 8, ``group`` the keys' token group ``G``,
    ``vgroup`` the values' channel group ``GV`` (dividing ``D``)."""

    kc: torch.Tensor
    ks: torch.Tensor
    kz: torch.Tensor
    kr: torch.Tensor
    vc: torch.Tensor
    vs: torch.Tensor
    vz: torch.Tensor
    ring: torch.Tensor
    tk: int
    nr: int
    tv: int
    nv: int
    head: int
    kbits: int
    vbits: int
    group: int
    vgroup: int

    @property
    def S(self) -> int:
        return self.kc.shape[0]

    @property
    def D(self) -> int:
        return self.kr.shape[-1]

    @property
    def length(self) -> int:
        """Entries per head."""
        return self.tk + self.nr

    @property
    def dtype(self) -> torch.dtype:
        """The cache dtype (of the full-precision rows)."""
        return self.kr.dtype

    @classmethod
    def of_state(cls, state) -> PackedKIVI:
        """The buffers of a :class:`kv_baselines.quant.kivi_decode.DecodeState` (duck-typed; views, no copy)."""
        return cls(
            kc=state.kc, ks=state.ks, kz=state.kz, kr=state.kr, vc=state.vc, vs=state.vs, vz=state.vz,
            ring=state.ring, tk=state.tk, nr=state.nr, tv=state.tv, nv=state.nv, head=state.head,
            kbits=state.kinfo[0].bits, vbits=state.vinfo[0].bits, group=state.kinfo[1],
            vgroup=state.vinfo[0].group_size,
        )  # fmt: skip


def unpack_token_inner(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """float32 ``[S, P * L, n]`` codes (channel ``p * L + lane``) of the first ``n`` tokens of token-inner bytes."""
    S, P, _ = packed.shape
    L = 8 // bits
    shifts = torch.arange(L, device=packed.device, dtype=torch.int32) * bits
    b = packed[:, :, None, :n].to(torch.int32)
    return ((b >> shifts.view(1, 1, L, 1)) & ((1 << bits) - 1)).reshape(S, P * L, n).float()


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return x
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype).float()


def dequantized(cache: PackedKIVI, rounded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(keys, values) [S, T, D]`` of every entry in entry order, the quantized ones as ``read()`` gives them
    (``zero + code * scale`` in float32, rounded to the cache dtype; left in float32 where not ``rounded``)."""
    S, D, T = cache.S, cache.D, cache.length
    G = cache.group
    dtype = cache.dtype if rounded else torch.float32
    keys = torch.empty(S, T, D, device=cache.kc.device)
    vals = torch.empty(S, T, D, device=cache.kc.device)
    if cache.tk:
        c = unpack_token_inner(cache.kc, cache.tk, cache.kbits)  # [S, D, tk]
        nG = cache.tk // G
        s = cache.ks[:, :, :nG].float().repeat_interleave(G, -1)
        z = cache.kz[:, :, :nG].float().repeat_interleave(G, -1)
        keys[:, : cache.tk] = _round(z + c * s, dtype).transpose(1, 2)
    keys[:, cache.tk :] = cache.kr[:, : cache.nr].float()
    if cache.tv:
        c = unpack_token_inner(cache.vc, cache.tv, cache.vbits)  # [S, D, tv]
        s = cache.vs[:, :, : cache.tv].float().repeat_interleave(cache.vgroup, 1)
        z = cache.vz[:, :, : cache.tv].float().repeat_interleave(cache.vgroup, 1)
        vals[:, : cache.tv] = _round(z + c * s, dtype).transpose(1, 2)
    if cache.nv:
        vals[:, cache.tv :] = cache.ring[:, : cache.nv].float().roll(-cache.head, 1)
    return keys, vals


def attention_over_dequantized(query: torch.Tensor, cache: PackedKIVI, scale: float, rounded: bool = True):
    """``(out float32 [S, M, D], lse float32 [S, M, 1])``: plain float32 attention over :func:`dequantized` entries
    (``rounded``: as ``read()`` hands them out, the contract's reference)."""
    k, v = dequantized(cache, rounded)
    logits = torch.bmm(query.float() * scale, k.transpose(1, 2))
    lse = torch.logsumexp(logits, -1, keepdim=True)
    return torch.bmm(torch.exp(logits - lse), v), lse


def row_errors(out, lse, ref_out, ref_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row ``[S, M]``: the output's relative error (L2 over the head dim; the reference's norm floored at
    :data:`FLOOR` times its RMS norm over all rows, as a near-cancelling average makes a relative error
    ill-conditioned) and the lse's absolute error."""
    out, ref_out = out.float(), ref_out.float()
    norm = ref_out.norm(dim=-1)
    floor = FLOOR * float(norm.pow(2).mean().sqrt()) if norm.numel() else 0.0
    rel = (out - ref_out).norm(dim=-1) / norm.clamp_min(max(floor, 1e-30))
    return rel, (lse.float() - ref_lse.float()).abs().view(rel.shape)


def contract_errors(out, lse, query: torch.Tensor, cache: PackedKIVI, scale: float) -> dict[str, float]:
    """How far ``(out, lse)`` of ``query`` over ``cache`` is from the contract (``docs/protocols.md``): the largest
    ratio, over query rows, of the error against attention over ``read()``'s entries to the allowance
    ``OUT_RTOL + 2 e_out`` / ``LSE_ATOL + 2 e_lse``, where ``e`` is the row's own error of ``read()``'s rounding
    (attention over ``read()`` against attention over the same codes dequantized in float32); ``<= 1`` meets it. The
    worst errors against ``read()`` (``out``, ``lse``) and against the float32 dequantization (``out_f32``,
    ``lse_f32``, to be within ``OUT_RTOL`` / ``LSE_ATOL``)."""
    ref = attention_over_dequantized(query, cache, scale)
    exact = attention_over_dequantized(query, cache, scale, rounded=False)
    return contract_summary(out, lse, ref, exact)


def contract_summary(out, lse, ref, exact, *, empty_rows: bool = False) -> dict[str, float]:
    """The contract's worst ratios and errors of ``(out, lse)`` given attention over ``read()``'s entries (``ref``)
    and over the float32 dequantization (``exact``), each an ``(out, lse)`` pair shaped as ``out``/``lse``: the
    measure :func:`contract_errors` reports, shared by the method packages' fast paths. ``empty_rows``: rows with
    nothing to attend (lse ``-inf`` on both sides, a NaN difference) count as exact."""
    rel, dl = row_errors(out, lse, *ref)
    frel, fdl = row_errors(*exact, *ref)
    xrel, xdl = row_errors(out, lse, *exact)

    def worst(t):
        if empty_rows:
            t = torch.nan_to_num(t, nan=0.0)
        return float(t.max()) if t.numel() else 0.0

    return {
        "out_ratio": worst(rel / (OUT_RTOL + 2 * frel)),
        "lse_ratio": worst(dl / (LSE_ATOL + 2 * fdl)),
        "out": worst(rel),
        "lse": worst(dl),
        "out_f32": worst(xrel),
        "lse_f32": worst(xdl),
    }


def within_tolerance(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    """``(worst output relative error, worst lse absolute error)`` over query rows (:func:`row_errors`)."""
    rel, dl = row_errors(out, lse, ref_out, ref_lse)
    return (float(rel.max()), float(dl.max())) if rel.numel() else (0.0, 0.0)


def kivi_decode_v2_ref(query: torch.Tensor, cache: PackedKIVI, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out float32 [S, M, D], lse float32 [S, M, 1])`` of ``query [S, M, D]`` (the ``M`` query rows of each KV
    head) over ``cache`` in the folded formulation (module docstring): PyTorch, any device, the reference of the
    Triton kernel. The folded operands are rounded as the kernel's matrix units take them: ``q ⊙ s_g`` to two float16
    parts (hi + lo), ``p ⊙ s_c`` to one; the full-precision rows enter in float32."""
    qs = query.float() * scale
    S, M, D = qs.shape
    tk, nr, tv, G = cache.tk, cache.nr, cache.tv, cache.group
    parts = []
    if tk:
        nG = tk // G
        c = unpack_token_inner(cache.kc, tk, cache.kbits).view(S, D, nG, G)
        s, z = cache.ks[:, :, :nG].float(), cache.kz[:, :, :nG].float()  # [S, D, nG]
        qf = qs[:, :, None, :] * s.transpose(1, 2)[:, None]  # [S, M, nG, D]
        qh = qf.half().float()
        qh += (qf - qh).half().float()  # two float16 parts, as the kernel's two products take them
        lk = torch.einsum("smgd,sdgt->smgt", qh, c) + torch.bmm(qs, z)[..., None]
        parts.append(lk.reshape(S, M, tk))
    if nr:
        parts.append(torch.bmm(qs, cache.kr[:, :nr].float().transpose(1, 2)))
    logits = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    mx = logits.amax(-1, keepdim=True)
    e = torch.exp(logits - mx)
    total = e.sum(-1, keepdim=True)
    out = torch.zeros(S, M, D, device=qs.device)
    if tv:
        GV = cache.vgroup
        C = D // GV
        c = unpack_token_inner(cache.vc, tv, cache.vbits).view(S, C, GV, tv)
        s, z = cache.vs[:, :, :tv].float(), cache.vz[:, :, :tv].float()  # [S, C, tv]
        eq = e[..., :tv]
        ph = (eq[:, None] * s[:, :, None]).half().float()  # [S, C, M, tv]
        oc = torch.einsum("scmt,scgt->smcg", ph, c).reshape(S, M, D)
        oz = torch.bmm(eq, z.transpose(1, 2))  # [S, M, C]
        out += oc + oz.repeat_interleave(GV, -1)
    if cache.nv:
        ring = cache.ring[:, : cache.nv].float().roll(-cache.head, 1)
        out += torch.bmm(e[..., tv:], ring)
    return out / total, torch.log(total) + mx


def kivi_decode_v2(query: torch.Tensor, cache: PackedKIVI, scale: float, **kernel_options):
    """The Triton kernel (:func:`kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton`) for CUDA caches of the
    shapes it takes (:func:`~kvcodec.kernels.triton_decode_v2.supported`), else :func:`kivi_decode_v2_ref`."""
    if use_triton(cache.kc):
        from kvcodec.kernels import triton_decode_v2 as kernel

        if kernel.supported(cache):
            return kernel.kivi_decode_v2_triton(query, cache, scale, **kernel_options)
    return kivi_decode_v2_ref(query, cache, scale)


# --------------------------------------------------------------------------------------------------------------------
# The paged layout (vLLM's block pool, kv_vllm.packed): blocks of N tokens packed with KIVI's layout, a block table
# --------------------------------------------------------------------------------------------------------------------

PAGED_BITS = (2, 4)
"""Code widths of the paged layout's packed blocks."""


def _check_tensor(name: str, t, ndim: int, dtypes: tuple | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"PagedPackedKIVI: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"PagedPackedKIVI: {name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"PagedPackedKIVI: {name} must be {names}, got {t.dtype}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"PagedPackedKIVI: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


_INDEX = (torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedPackedKIVI:
    """One layer's KIVI cache in vLLM's paged layout: a pool of packed blocks, a block table and a full-precision
    open block per sequence (``docs/protocols.md``, "Paged decode layout").

    A block holds ``N`` tokens of every KV head quantized as :mod:`kv_vllm.packed` packs a vLLM block (KIVI's
    grouping): keys **per channel over groups of** ``G`` **tokens** (``N`` a multiple of ``G``; the vLLM backend
    uses ``G = N``, one group per block), values **per token in groups of** ``GV`` **channels**, with their scales
    and zeros. The pool's tensors, ``P = D * bits / 8`` code bytes per token (byte ``p`` holds channels ``p * L ..
    p * L + L - 1``, ``L = 8 // bits`` little-endian lanes, as :func:`kvcodec.packing.pack_codes`):

    * ``kc uint8 [num_blocks, H, P, N]``, token-inner key codes; ``ks, kz [num_blocks, H, D, N // G]``;
    * ``vc uint8 [num_blocks, H, P, N]``, token-inner value codes; ``vs, vz [num_blocks, H, D // GV, N]``.

    Sequence ``b`` has ``seq_lens[b]`` entries: its first ``n_b = (seq_lens[b] - tail_lens[b]) / N`` blocks are packed,
    logical block ``i < n_b`` at pool block ``block_table[b, i]`` (``int32``/``int64 [B, max_blocks]``; entries past
    ``n_b`` are not read); the last ``tail_lens[b]`` entries (``0 .. R``) are the **open block**, at full precision in
    ``tail_k, tail_v [B, H, R, D]`` (entry order, cache dtype), as vLLM's packed backend stages a block until it is
    complete (``OpenBlocks``; a decode step's query attends to ``n_b = (L - 1) // N`` packed blocks and a tail of
    ``1 .. N`` tokens, the just-completed block packed after the step). ``kbits``/``vbits`` are 2 or 4
    (:data:`PAGED_BITS`).

    Construction checks shapes and dtypes (no device sync): ``TypeError`` for a wrong type or dtype,
    ``ValueError`` for a wrong shape, bits or grouping, each naming the argument; :meth:`check_values` checks the
    contents (block ids, lengths), which needs their values on the host."""

    kc: torch.Tensor
    ks: torch.Tensor
    kz: torch.Tensor
    vc: torch.Tensor
    vs: torch.Tensor
    vz: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    tail_lens: torch.Tensor
    kbits: int
    vbits: int
    group: int
    vgroup: int

    def __post_init__(self) -> None:
        for name in ("kbits", "vbits", "group", "vgroup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"PagedPackedKIVI: {name} must be an int, got {type(v).__name__}")
        for name in ("kbits", "vbits"):
            if getattr(self, name) not in PAGED_BITS:
                raise ValueError(f"PagedPackedKIVI: {name} must be one of {PAGED_BITS}, got {getattr(self, name)}")
        _check_tensor("tail_k", self.tail_k, 4, _FLOATS)
        B, H, R, D = self.tail_k.shape
        _check_tensor("tail_v", self.tail_v, 4, (self.tail_k.dtype,))
        _check_shape("tail_v", self.tail_v, (B, H, R, D))
        _check_tensor("kc", self.kc, 4, (torch.uint8,))
        nb, N = self.kc.shape[0], self.kc.shape[3]
        G, GV = self.group, self.vgroup
        if G < 1 or N % G:
            raise ValueError(f"PagedPackedKIVI: the block size {N} must be a multiple of the key group {G} (group)")
        if GV < 1 or D % GV:
            raise ValueError(f"PagedPackedKIVI: vgroup {GV} must divide the head dim {D}")
        _check_shape("kc", self.kc, (nb, H, D * self.kbits // 8, N))
        _check_tensor("vc", self.vc, 4, (torch.uint8,))
        _check_shape("vc", self.vc, (nb, H, D * self.vbits // 8, N))
        for name, shape in (("ks", (nb, H, D, N // G)), ("kz", (nb, H, D, N // G))):
            _check_tensor(name, getattr(self, name), 4, _FLOATS)
            _check_shape(name, getattr(self, name), shape)
        for name in ("vs", "vz"):
            _check_tensor(name, getattr(self, name), 4, _FLOATS)
            _check_shape(name, getattr(self, name), (nb, H, D // GV, N))
        _check_tensor("block_table", self.block_table, 2, _INDEX)
        if self.block_table.shape[0] != B:
            raise ValueError(f"PagedPackedKIVI: block_table has {self.block_table.shape[0]} rows, tail_k {B} sequences")
        for name in ("seq_lens", "tail_lens"):
            _check_tensor(name, getattr(self, name), 1, _INDEX)
            _check_shape(name, getattr(self, name), (B,))

    @property
    def B(self) -> int:
        """Sequences."""
        return self.tail_k.shape[0]

    @property
    def H(self) -> int:
        """KV heads."""
        return self.tail_k.shape[1]

    @property
    def D(self) -> int:
        """Head dim."""
        return self.tail_k.shape[3]

    @property
    def block_size(self) -> int:
        """Tokens per block ``N``."""
        return self.kc.shape[3]

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.kc.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The cache dtype (of the open block)."""
        return self.tail_k.dtype

    def check_values(self) -> None:
        """Check the contents: ``0 <= tail_lens <= R`` and ``<= seq_lens``, whole blocks before the tail, no more
        blocks than the table holds, and the block ids the sequences use in ``[0, num_blocks)``.

        Raises
        ------
        ValueError
            Naming the argument and the first offending sequence.
        """
        lens = self.seq_lens.tolist()
        tails = self.tail_lens.tolist()
        N, R, width = self.block_size, self.tail_k.shape[2], self.block_table.shape[1]
        table = self.block_table.cpu()
        for b, (L, nt) in enumerate(zip(lens, tails, strict=True)):
            if L < 0 or not 0 <= nt <= min(R, L):
                raise ValueError(
                    f"PagedPackedKIVI: sequence {b} has seq_lens {L} and tail_lens {nt}: the tail must hold 0 .. "
                    f"min(seq_lens, {R}) entries (tail_k's capacity)"
                )
            if (L - nt) % N:
                raise ValueError(
                    f"PagedPackedKIVI: sequence {b}: seq_lens {L} - tail_lens {nt} is not a whole number of "
                    f"{N}-token blocks"
                )
            n = (L - nt) // N
            if n > width:
                raise ValueError(
                    f"PagedPackedKIVI: sequence {b}'s seq_lens {L} needs {n} packed blocks, beyond the block_table's "
                    f"{width} columns"
                )
            ids = table[b, :n]
            if n and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
                raise ValueError(
                    f"PagedPackedKIVI: block_table row {b} names block ids outside [0, {self.num_blocks}): "
                    f"{ids.tolist()}"
                )

    def packed_blocks(self, b: int) -> int:
        """The number of packed blocks of sequence ``b`` (host value)."""
        return (int(self.seq_lens[b]) - int(self.tail_lens[b])) // self.block_size

    def check_query(self, query: torch.Tensor, scale: float) -> int:
        """The GQA group ``M`` of ``query [B, H * M, D]`` over this cache (:func:`check_paged_query`; a method, so a
        kernel that takes the cache checks its query without importing this module)."""
        return check_paged_query(query, self, scale)

    def sequence(self, b: int) -> PackedKIVI:
        """Sequence ``b`` as a contiguous :class:`PackedKIVI` (``S = H``; a copy): its packed blocks gathered through
        the block table and concatenated in logical order as the quantized entries, the open block as the key
        residual and the value ring (turned by 0)."""
        n, nt = self.packed_blocks(b), int(self.tail_lens[b])
        ids = self.block_table[b, :n].to(self.kc.device, torch.long)

        def cat(t: torch.Tensor) -> torch.Tensor:  # [nb, H, X, Y] -> [H, X, n * Y]: blocks back to back
            g = t.index_select(0, ids)
            return g.permute(1, 2, 0, 3).reshape(g.shape[1], g.shape[2], n * g.shape[3]).contiguous()

        tk = n * self.block_size
        return PackedKIVI(
            kc=cat(self.kc), ks=cat(self.ks), kz=cat(self.kz), kr=self.tail_k[b], vc=cat(self.vc),
            vs=cat(self.vs), vz=cat(self.vz), ring=self.tail_v[b], tk=tk, nr=nt, tv=tk, nv=nt, head=0,
            kbits=self.kbits, vbits=self.vbits, group=self.group, vgroup=self.vgroup,
        )  # fmt: skip


def check_paged_query(query: torch.Tensor, cache: PagedPackedKIVI, scale: float) -> int:
    """The GQA group ``M`` of ``query [B, H * M, D]`` over ``cache``.

    Raises
    ------
    TypeError
        ``query`` not a floating tensor, ``scale`` not a real number.
    ValueError
        ``query``'s shape does not fit the cache.
    """
    if not isinstance(query, torch.Tensor) or query.dtype not in _FLOATS:
        raise TypeError(f"query must be a float16/bfloat16/float32 tensor, got {getattr(query, 'dtype', query)!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    B, H, D = cache.B, cache.H, cache.D
    if query.dim() != 3 or query.shape[0] != B or query.shape[2] != D or H == 0 or query.shape[1] % H:
        raise ValueError(f"query must be [B={B}, H*M (a multiple of {H}), D={D}], got {tuple(query.shape)}")
    return query.shape[1] // H


def paged_decode_reference(
    query: torch.Tensor, cache: PagedPackedKIVI, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention v2 over a paged cache, in PyTorch: the reference of the paged Triton kernel
    (:func:`kvcodec.kernels.triton_decode_v2_paged.paged_decode_v2_triton`, same signature).

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, D]``, one decode query per sequence and query head, ``Hq = H * M`` (query head ``h * M + m``
        reads KV head ``h``).
    cache : PagedPackedKIVI
        The layer's paged cache (its contents are checked: :meth:`PagedPackedKIVI.check_values`).
    scale : float
        The softmax scale.

    Returns
    -------
    out : torch.Tensor
        float32 ``[B, Hq, D]``: per sequence, :func:`kivi_decode_v2_ref` over :meth:`PagedPackedKIVI.sequence`
        (zeros for an empty sequence).
    lse : torch.Tensor
        float32 ``[B, Hq, 1]``, the log-sum-exp of the scaled logits (``-inf`` for an empty sequence).
    """
    M = check_paged_query(query, cache, scale)
    cache.check_values()
    B, H, D = cache.B, cache.H, cache.D
    out = torch.zeros(B, H * M, D, dtype=torch.float32, device=query.device)
    lse = torch.full((B, H * M, 1), float("-inf"), dtype=torch.float32, device=query.device)
    for b in range(B):
        if int(cache.seq_lens[b]) == 0 or M == 0:
            continue
        o, s = kivi_decode_v2_ref(query[b].view(H, M, D), cache.sequence(b), scale)
        out[b] = o.reshape(H * M, D)
        lse[b] = s.reshape(H * M, 1)
    return out, lse


def paged_contract_errors(out, lse, query: torch.Tensor, cache: PagedPackedKIVI, scale: float) -> dict[str, float]:
    """:func:`contract_errors` of ``(out [B, Hq, D], lse [B, Hq, 1])`` over a paged cache: the worst of each entry
    over the non-empty sequences (each against attention over its :meth:`PagedPackedKIVI.sequence`)."""
    M = check_paged_query(query, cache, scale)
    H, D = cache.H, cache.D
    worst: dict[str, float] = {}
    for b in range(cache.B):
        if int(cache.seq_lens[b]) == 0 or M == 0:
            continue
        e = contract_errors(
            out[b].view(H, M, D), lse[b].view(H, M, 1), query[b].view(H, M, D), cache.sequence(b), scale
        )
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in e.items()}
    return worst


def kivi_decode_v2_paged(query: torch.Tensor, cache: PagedPackedKIVI, scale: float, **kernel_options):
    """The paged Triton kernel (:func:`kvcodec.kernels.triton_decode_v2_paged.paged_decode_v2_triton`) for CUDA caches
    of the shapes it takes (:func:`~kvcodec.kernels.triton_decode_v2_paged.supported`), else
    :func:`paged_decode_reference`.

    Parameters
    ----------
    query, cache, scale
        As :func:`paged_decode_reference`.
    **kernel_options
        Passed to the kernel (ignored by the reference).

    Returns
    -------
    tuple of torch.Tensor
        ``(out float32 [B, Hq, D], lse float32 [B, Hq, 1])``.
    """
    if use_triton(cache.kc):
        from kvcodec.kernels import triton_decode_v2_paged as kernel

        if kernel.supported(cache):
            return kernel.paged_decode_v2_triton(query, cache, scale, **kernel_options)
    return paged_decode_reference(query, cache, scale)
