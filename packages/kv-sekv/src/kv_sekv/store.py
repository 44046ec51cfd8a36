"""The SEKV store: accelerator-resident anchors, window and span summaries, CPU low-rank span bases, and the
two-stage query-dependent decode of SEKV §3.3.

Written from a :class:`~kv_sekv.SpanPlan`, one layer holds

* on the accelerator: resident tokens at full precision (anchors, short spans, the window, decoded tokens) in a
  :class:`kvcore.DenseStore`; per span and KV head a coarse entry ``(k̄_S, v̄_S)`` (Eq. 2); per span and query head
  a unit routing summary ``K̄_S`` (Eq. 3);
* on the CPU (pinned when CUDA is available): each span's keys and values as gated low-rank factors, or raw when
  the factors would be larger (Eqs. 6–8, 18). The original span K/V are discarded: the span tier is lossy, its error
  per component bounded by Eq. 14.

Decode (``read(query)`` / ``attend(query, scale)``): the gate ``α̃_S = sigmoid(q′·K̄_S/√d′ + log|S|)`` with
``q′ = W q`` (Eqs. 4–5) selects spans with ``α̃_S > τ`` (Eq. 9); a KV-head span is reconstructed when any query head
of its group (and any query of the step) selects it, with priority the largest such gate (GQA choice); when the
selections exceed the budget, the (KV head, span) pairs are taken in decreasing gate order until it is filled —
a pair that no longer fits is skipped and the next, smaller one is tried (with a strict prefix, one long top-gate
span that does not fit would block every expansion: on SmolLM2 that left zero spans expanded).
Expanded spans are attended as their reconstructed tokens (bias 0) in place of their coarse entry; every
other span is one coarse entry with logit bias ``+log|S|``; one softmax covers all of it (Stage 1 over the
accelerator-resident entries and Stage 2 over the fetched spans, merged by log-sum-exp). Every query head of a group
sees the group's reconstructed spans (they are on the accelerator anyway), so the view stays at KV-head granularity.

A plain :class:`kvcore.Plan` (no segmentation) is held as resident full-precision tokens, like ``DenseStore``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from kvcore import EVICT, FULL, DenseStore, KVView, Plan, Store
from kvcore.attention import check_query, check_scale
from kvcore.checks import check_finite, check_int, check_integer_tensor, check_positions, check_tensor, values_checked
from kvcore.memory import storage_bytes
from kvcore.transfer import from_host

from .bases import SpanBasis, truncated_svd
from .config import SEKVConfig
from .kernels import biased_attention, routing_priority
from .kernels.dispatch import biased_attention_splits, factored_items, merge_splits
from .plan import SpanPlan
from .router import RouterSource
from .summaries import coarse_entries, routing_summaries

__all__ = ["FETCH_MODES", "SEKVStore", "StepStats"]

#: how ``attend`` fetches the expanded spans' factors (:class:`SEKVStore`'s ``fetch``)
FETCH_MODES = ("sync", "thread", "stream")


@dataclass
class _Spans:
    """Span state of one layer (rows padded to ``M`` spans)."""

    length: torch.Tensor  # [B, M] int64, 0 = padding
    last_pos: torch.Tensor  # [B, M] int64, -1 = padding
    alive: torch.Tensor  # [B, Hkv, M] bool
    coarse_k: torch.Tensor  # [B, Hkv, M, D]
    coarse_v: torch.Tensor  # [B, Hkv, M, D]
    summary: torch.Tensor  # [B, Hq, M, d'] unit routing summaries (keys dtype)
    token_pos: list[list[torch.Tensor]]  # [b][s] -> [|S|] int64 true positions (accelerator)
    key_basis: list[list[SpanBasis]]  # [b][s] (CPU)
    value_basis: list[list[SpanBasis]]
    capacity: list[int]  # budget in tokens per KV head at prefill, per row
    prefill_last: list[int]  # last prefill position per row (decoded tokens come after)
    budget: float  # fraction of the full cache; 1.0 = no cap
    host: tuple[list[list[int]], list[int]] | None = None  # on_host(), once the gate asked
    # decoded tokens per row (the most any KV head holds past the prefill), on the host: read once with the gates,
    # then advanced by appends; None after any other edit (found again at the next capped step)
    decoded: list[int] | None = None

    def on_host(self) -> tuple[list[list[int]], list[int]]:
        """``(length[b][span], alive spans of row b over its KV heads)`` as Python ints, read once (a span state is
        never edited in place: a re-tier or reorder builds a new one), for Stage 2's host-side span choice."""
        if self.host is None:
            self.host = (self.length.tolist(), self.alive.sum((1, 2)).tolist())
        return self.host

    def tensors(self) -> list[torch.Tensor]:
        out = [self.length, self.last_pos, self.alive, self.coarse_k, self.coarse_v, self.summary]
        out += [t for row in self.token_pos for t in row]
        for rows in (self.key_basis, self.value_basis):
            out += [t for row in rows for basis in row for t in basis.tensors()]
        return out


@dataclass
class StepStats:
    """What the last ``read(query)`` / ``attend`` did: spans expanded, tokens reconstructed, bytes fetched from the
    CPU (Eq. 20) and gates selected before the cap."""

    expanded: int = 0
    selected: int = 0
    tokens: int = 0
    fetched_bytes: int = 0


@dataclass
class SEKVStore(Store):
    """One layer of SEKV's cache (module docstring).

    Parameters
    ----------
    router : RouterSource, optional
        The router (``W``, ``τ``, ``g_φ``); required to write a :class:`~kv_sekv.SpanPlan` with spans.
    config : SEKVConfig
        ``R_max`` and the gate-drop threshold ``ε`` (``gate_eps``).
    fetch : {"sync", "thread", "stream"}
        How ``attend`` fetches the selected spans' factors (pinned host memory, copied without blocking the host):
        after Stage 1 is issued, on the compute stream (``"sync"``); on a worker thread while Stage 1 runs
        (``"thread"``); or, on CUDA, on a copy stream of its own issued before Stage 1, so the copy engine moves the
        factors while the GPU runs Stage 1 and Stage 2 waits for them by an event (``"stream"``: the overlap of
        §3.3; off CUDA, the synchronous path). Same result either way.
    reconstruct : bool
        ``False`` is Table 5's "w/o SVD reconstruction": no span basis is kept (the span tokens are dropped after
        their coarse entry and summaries are computed) and no span is ever expanded; the accelerator tier is SEKV's.
    """

    supported_bits = frozenset({EVICT, FULL})
    query_dependent = True
    can_attend = True

    router: RouterSource | None = None
    config: SEKVConfig = field(default_factory=SEKVConfig)
    fetch: str = "sync"
    reconstruct: bool = True

    def __post_init__(self) -> None:
        if self.fetch not in FETCH_MODES:
            raise ValueError(f"fetch must be one of {FETCH_MODES}, got {self.fetch!r}")
        if not isinstance(self.reconstruct, bool):
            raise TypeError(f"reconstruct must be a bool, got {type(self.reconstruct).__name__}")
        if self.router is not None and not isinstance(self.router, RouterSource):
            raise TypeError(f"router must be a kv_sekv.SEKVRouter or RouterSource, got {type(self.router).__name__}")
        if not isinstance(self.config, SEKVConfig):
            raise TypeError(f"config must be a kv_sekv.SEKVConfig, got {type(self.config).__name__}")
        # the router is shared by every layer: hold it behind a bound method so the memory walker (and nbytes)
        # counts only this layer's cache
        self._resolve = None if self.router is None else self.router.resolve
        self.router = None
        self.layer = 0
        self.last_step = StepStats()
        self.reset()

    # -- state ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._dense = DenseStore()
        self._spans: _Spans | None = None
        self.alpha: list[float] = []
        self.used: list[float] = []

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes held on ``device`` (``"cpu"``: the span bases; the accelerator: resident tokens, coarse entries
        and summaries), or everywhere."""
        spans = [] if self._spans is None else self._spans.tensors()
        return self._dense.nbytes(device) + storage_bytes(spans, device)

    def resident_nbytes(self) -> int:
        """Bytes on the accelerator tier (resident tokens, coarse entries, summaries, span metadata): what the
        SEKV budget (§3.2) is charged for; the span bases kept in host memory are left out."""
        return self.bytes_by_tier()["resident"]

    def bytes_by_tier(self) -> dict[str, int]:
        """``{"resident": ..., "bases": ...}``: bytes of what lives on the accelerator (resident tokens, coarse entries,
        summaries, span metadata) and of the span bases kept in CPU memory, whatever device this runs on."""
        sp = self._spans
        if sp is None:
            return {"resident": self._dense.nbytes(), "bases": 0}
        bases = [t for rows in (sp.key_basis, sp.value_basis) for row in rows for basis in row for t in basis.tensors()]
        on_acc = [t for t in sp.tensors() if all(t is not u for u in bases)]
        return {"resident": self._dense.nbytes() + storage_bytes(on_acc), "bases": storage_bytes(bases)}

    # -- write -----------------------------------------------------------------------------------------------
    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """Replace the content per ``plan``; all-or-nothing (everything is built before anything is swapped in)."""
        dense = DenseStore()
        if not isinstance(plan, SpanPlan):
            dense.write(keys, values, plan, positions)
            self._dense, self._spans, self.alpha, self.used = dense, None, [], []
            return
        check_tensor("keys", keys, ndim=4)
        B, H, T, _D = keys.shape
        if tuple(plan.key_bits.shape) != (B, H, T):
            raise ValueError(f"plan must be a SpanPlan of shape [B={B}, H={H}, T={T}]")
        span_id = plan.span_id.to(keys.device)
        in_span = span_id >= 0
        if bool((plan.key_bits.to(keys.device)[:, :, :] != FULL)[in_span[:, None, :].expand(B, H, T)].any()):
            raise ValueError("span tokens (span_id >= 0) must be kept (FULL) in every KV head of the plan")
        resident = plan.keep_keys.to(keys.device) & ~in_span[:, None, :]
        vres = plan.keep_values.to(keys.device) & ~in_span[:, None, :]
        dense.write(keys, values, Plan.from_keep(resident, vres), positions)  # validates keys, values, positions
        check_positions("positions", positions, (B, T), keep=plan.keep_keys.to(keys.device))
        check_finite("keys", keys[:, :, in_span.any(0)] if bool(in_span.any()) else keys[..., :0, :])
        check_finite("values", values[:, :, in_span.any(0)] if bool(in_span.any()) else values[..., :0, :])
        spans = None
        if bool(in_span.any()):
            spans = self._build_spans(keys, values, plan, positions.to(keys.device).long(), span_id)
        self._dense, self._spans, self.layer = dense, spans, plan.layer
        self.alpha = [] if plan.alpha is None else [float(a) for a in plan.alpha]
        self.used = [] if plan.used is None else [float(u) for u in plan.used]

    def _router(self, num_kv_heads: int, head_dim: int):
        if self._resolve is None:
            raise ValueError("SEKVStore(router=...) is needed to hold spans (a SpanPlan with span_id >= 0)")
        return self._resolve(num_kv_heads, head_dim)

    def _build_spans(self, keys, values, plan: SpanPlan, positions, span_id) -> _Spans:
        B, H, T, D = keys.shape
        router = self._router(H, D)
        router.check(plan.layer, H, D)
        routing = router.layer(plan.layer)
        W = routing.W.to(keys.device)
        Hq, dp = W.shape[0], W.shape[1]
        g = Hq // H
        counts = [int(span_id[b].max()) + 1 if bool((span_id[b] >= 0).any()) else 0 for b in range(B)]
        M = max(counts)
        length = torch.zeros(B, M, dtype=torch.long, device=keys.device)
        last_pos = torch.full((B, M), -1, dtype=torch.long, device=keys.device)
        coarse_k = torch.zeros(B, H, M, D, dtype=keys.dtype, device=keys.device)
        coarse_v = torch.zeros_like(coarse_k)
        summary = torch.zeros(B, Hq, M, dp, dtype=keys.dtype, device=keys.device)
        token_pos, kb, vb = [], [], []
        weights = plan.weights.to(keys.device).float()
        R = self.config.max_rank
        for b in range(B):
            m = counts[b]
            token_pos.append([])
            kb.append([None] * m)
            vb.append([None] * m)
            if m == 0:
                continue
            sid = span_id[b]
            ck = coarse_entries(keys[b], sid, weights[b], m)
            cv = coarse_entries(values[b], sid, weights[b], m)
            summ = routing_summaries(ck, W)  # [Hq, m, d']
            coarse_k[b, :, :m], coarse_v[b, :, :m] = ck.to(keys.dtype), cv.to(keys.dtype)
            summary[b, :, :m] = summ.to(keys.dtype)
            gsum = summ.view(H, g, m, dp).mean(1)  # g_φ input: the group mean (GQA choice)
            lens = torch.bincount(sid[sid >= 0], minlength=m)
            length[b, :m] = lens
            order = torch.argsort(sid.masked_fill(sid < 0, m), stable=True)[: int(lens.sum())]
            starts = torch.cumsum(lens, 0) - lens
            for s in range(m):
                idx = order[int(starts[s]) : int(starts[s] + lens[s])]
                token_pos[b].append(positions[b, idx].clone())
            last_pos[b, :m] = torch.stack([p[-1] for p in token_pos[b]])
            if not self.reconstruct:  # Table 5 "w/o SVD reconstruction": nothing kept to expand
                kb[b], vb[b] = [SpanBasis() for _ in range(m)], [SpanBasis() for _ in range(m)]
                continue
            for L in torch.unique(lens).tolist():
                group = (lens == L).nonzero()[:, 0]
                idx = torch.stack([order[int(starts[s]) : int(starts[s]) + L] for s in group.tolist()])  # [n, L]
                for x, out, is_value in ((keys[b], kb, False), (values[b], vb, True)):
                    X = x[:, idx]  # [H, n, L, D]
                    U, sig, Vh = truncated_svd(X, R)
                    gates = router.gates(sig, gsum[:, group], is_value)
                    for j, s in enumerate(group.tolist()):
                        out[b][s] = SpanBasis.build(
                            X[:, j], U[:, j], sig[:, j], Vh[:, j], gates[:, j], self.config.gate_eps, "cpu"
                        )
        valid = plan.key_bits[:, 0] != EVICT
        prefill_last = [int(positions[b][valid[b]].max()) if bool(valid[b].any()) else -1 for b in range(B)]
        capacity = [int(c) for c in plan.capacity] if plan.capacity is not None else [T] * B
        return _Spans(
            length,
            last_pos,
            (length > 0)[:, None, :].expand(B, H, M).clone(),
            coarse_k,
            coarse_v,
            summary,
            token_pos,
            kb,
            vb,
            capacity,
            prefill_last,
            float(plan.budget),
        )

    # -- decode ------------------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Decoded tokens are held at full precision with the resident tokens."""
        if self._spans is not None:
            B = self._spans.length.shape[0]
            pos = check_integer_tensor("positions", positions, ndim=2)
            if pos.shape[0] == B and pos.numel() and values_checked(keys):
                last = self._spans.last_pos.max(-1).values.to(pos.device)
                if bool((pos.long().min(-1).values <= last).any()):
                    raise ValueError("positions of appended entries must come after every position held in their row")
        self._dense.append(keys, values, positions)
        if self._spans is not None and self._spans.decoded is not None:  # every head of every row gained them
            self._spans.decoded = [d + keys.shape[2] for d in self._spans.decoded]

    def _stage1_entries(self, base: KVView, expanded: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``(keys, values, bias, show)``: the resident entries of ``base`` (the dense read), then every span's coarse
        entry, shown (bias ``log|S|``) where the span is alive and not ``expanded``, else bias ``-inf``; in no
        particular order (attention is order-free) and with no host read."""
        sp = self._spans
        show = sp.alive if expanded is None else sp.alive & ~expanded.to(sp.alive.device)
        bias_c = torch.where(show, torch.log(sp.length.clamp_min(1).float())[:, None, :], float("-inf"))
        bias = torch.cat([base.logit_bias.float(), bias_c], -1)
        keys = torch.cat([base.keys, sp.coarse_k.to(base.keys.dtype)], 2)
        values = torch.cat([base.values, sp.coarse_v.to(base.values.dtype)], 2)
        return keys, values, bias, show

    def _coarse_view(self, expanded: torch.Tensor | None) -> tuple[KVView, torch.Tensor, torch.Tensor]:
        """Resident entries + coarse entries of the non-expanded alive spans, sorted by position per head.

        Returns ``(view, kind, src)``: ``kind`` 0 padding, 1 resident (``src`` = index in the dense read), 2 coarse
        (``src`` = span index)."""
        base = self._dense.read()
        sp = self._spans
        B, H, N, _D = base.keys.shape
        if sp is None:
            kind = torch.where(base.positions >= 0, 1, 0)
            return base, kind, torch.arange(N, device=base.keys.device).expand(B, H, N)
        M = sp.length.shape[1]
        keys, values, bias, show = self._stage1_entries(base, expanded)
        pos = torch.cat([base.positions, torch.where(show, sp.last_pos[:, None, :], -1)], -1)
        ar = torch.arange(N + M, device=pos.device)
        kind = torch.cat([torch.ones(B, H, N, dtype=torch.long), torch.full((B, H, M), 2)], -1).to(pos.device)
        src = torch.where(ar < N, ar, ar - N).expand(B, H, N + M)
        return _sorted(keys, values, pos, bias, kind, src)

    def _zoom(
        self, query: torch.Tensor, base: KVView | None = None
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]], StepStats, torch.Tensor]:
        """``(expanded, chosen, stats, coarse_bias)``: the spans to reconstruct for ``query`` (gate, threshold, GQA
        union, budget cap) as a ``[B, Hkv, M]`` bool mask on the CPU and as sorted ``(b, h, span)`` triples, and the
        coarse entries' Stage-1 bias before expansion (``log|S|`` where alive, else ``-inf``; from the routing
        launch); one host read of the accelerator per call (the gates and the budget's counts), the span choice in
        Python. ``base``: the dense read the caller already made."""
        sp = self._spans
        B, H, M = sp.alive.shape
        router = self._router(H, sp.coarse_k.shape[-1])
        routing = router.layer(self.layer, query.device)
        Hq = query.shape[1]
        if Hq != routing.W.shape[0]:
            raise ValueError(f"query has {Hq} heads; the router was trained for {routing.W.shape[0]} query heads")
        # each KV head's strongest selecting gate (Eqs. 4-5, 9; -1: none selects the span), one launch on CUDA, goes
        # to the host with what the budget cap needs, in one copy: Stage 2's span choice is a host decision (it
        # drives the CPU -> GPU fetch), made in Python on that copy
        prio, coarse_bias = routing_priority(query, routing.W, routing.tau, sp.summary, sp.length, sp.alive)
        capped = self.reconstruct and sp.budget < 1.0
        parts = [prio.flatten()]
        held = self._dense.uniform_length() if capped else None  # resident per head, known on the host
        if capped:
            if held is None:  # resident per head (includes decoded tokens), read with the gates
                parts.append(self._dense.seq_lengths().to(query.device).float().flatten())
            if sp.decoded is None:
                rpos = (self._dense.read() if base is None else base).positions
                decoded = (rpos > from_host(sp.prefill_last, rpos.device)[:, None, None]).sum(-1).amax(-1)
                parts.append(decoded.float().to(query.device))
        host = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()  # the one host read
        if capped and sp.decoded is None:
            sp.decoded = [int(d) for d in host[-B:]]
        length, alive = sp.on_host()
        flat = [i for i, p in enumerate(host[: B * H * M]) if p >= 0]  # (b, h, span) in flat order
        selected = [(i // (H * M), i // M % H, i % M) for i in flat]
        stats = StepStats(selected=len(selected))
        if not self.reconstruct:
            chosen = []
        elif capped:
            cost = router.summary_cost(H, sp.coarse_k.shape[-1])
            lens_h = [held] * (B * H) if held is not None else host[B * H * M : B * H * M + B * H]
            decoded_h = sp.decoded
            chosen = []
            for b in range(B):
                cap = H * (sp.capacity[b] + math.ceil(sp.budget * int(decoded_h[b])))
                used = float(sum(lens_h[b * H : (b + 1) * H])) + float(alive[b]) * (1.0 + cost)
                room = cap - used
                # descending gate, the lower (head, span) index first among equal gates (a stable sort)
                for i in sorted((i for i in flat if i // (H * M) == b), key=lambda i: -host[i]):
                    m = i % M
                    if length[b][m] <= room:  # fill: skip what does not fit, go on
                        chosen.append((b, i // M % H, m))
                        room -= length[b][m]
            chosen.sort()
        else:
            chosen = selected
        expanded = torch.zeros(B, H, M, dtype=torch.bool)
        if chosen:
            expanded[tuple(torch.tensor(c) for c in zip(*chosen))] = True
        stats.expanded = len(chosen)
        stats.tokens = sum(length[b][m] for b, _, m in chosen)
        return expanded, chosen, stats, coarse_bias

    def _expanded_tokens(self, chosen: list[tuple[int, int, int]], B: int, H: int, device, dtype):
        """Reconstructed tokens of the expanded ``(b, h, span)`` triples, per head, as ``(keys, values, positions)``
        lists."""
        sp = self._spans
        per_head = [[[] for _ in range(H)] for _ in range(B)]
        fetched = 0
        for b, s in sorted({(b, s) for b, _, s in chosen}):
            heads = torch.tensor([h for bb, h, ss in chosen if (bb, ss) == (b, s)])
            kb, vb = sp.key_basis[b][s].select(heads), sp.value_basis[b][s].select(heads)
            fetched += sum(t.numel() * t.element_size() for t in kb.tensors() + vb.tensors())
            k, v = kb.reconstruct(device).to(dtype), vb.reconstruct(device).to(dtype)
            for j, h in enumerate(heads.tolist()):
                per_head[b][h].append((k[j], v[j], sp.token_pos[b][s]))
        return per_head, fetched

    def read(self, query: torch.Tensor | None = None) -> KVView:
        """Without ``query``: resident entries and every span as its coarse entry (bias ``log|S|``). With ``query``
        ``[B, Hq, Q, D]``: the spans the gate selects (under the budget) as reconstructed tokens instead."""
        if self._spans is None or query is None:
            return self._coarse_view(None)[0]
        base = self._dense.read()
        q = check_query(query, base.keys.shape[1], base.keys.shape[-1], base.keys.shape[0])
        expanded, chosen, stats, _ = self._zoom(q, base)
        view, _kind, _ = self._coarse_view(expanded)
        B, H, _, D = view.keys.shape
        per_head, stats.fetched_bytes = self._expanded_tokens(chosen, B, H, view.keys.device, view.keys.dtype)
        self.last_step = stats
        E = max((sum(x[0].shape[0] for x in per_head[b][h]) for b in range(B) for h in range(H)), default=0)
        if E == 0:
            return view
        ek = view.keys.new_zeros(B, H, E, D)
        ev = view.values.new_zeros(B, H, E, D)
        ep = torch.full((B, H, E), -1, dtype=torch.long, device=view.keys.device)
        for b in range(B):
            for h in range(H):
                if per_head[b][h]:
                    k, v, p = (torch.cat(x) for x in zip(*per_head[b][h]))
                    n = k.shape[0]
                    ek[b, h, :n], ev[b, h, :n], ep[b, h, :n] = k, v, p
        eb = torch.where(ep >= 0, 0.0, float("-inf"))
        keys = torch.cat([view.keys, ek], 2)
        values = torch.cat([view.values, ev], 2)
        pos = torch.cat([view.positions, ep], 2)
        bias = torch.cat([view.logit_bias, eb], 2)
        return _sorted(keys, values, pos, bias, pos, pos)[0]

    def attend(self, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Two-stage decode attention (§3.3): Stage 1 over the accelerator-resident entries with the ``log|S|`` bias
        of non-expanded spans, Stage 2 over the expanded spans from their factors (never rebuilding ``K̂``/``V̂``),
        merged by log-sum-exp — equal to :func:`kvcore.reference_attention` over ``read(query)``."""
        base = self._dense.read()
        B, H, _, D = base.keys.shape
        q = check_query(query, H, D, B)
        scale = check_scale(scale, D)
        if self._spans is None:
            return biased_attention(base.keys, base.values, None if base.bias_free else base.logit_bias, q, scale)
        _expanded, chosen, stats, bias_c = self._zoom(q, base)
        sp = self._spans
        pairs = sorted({(b, h) for b, h, _ in chosen})
        spans = {(b, h): [s for bb, hh, s in chosen if (bb, hh) == (b, h)] for b, h in pairs}

        def fetch() -> dict:
            return {
                (b, h, s): (_factors(sp.key_basis[b][s], h, q.device), _factors(sp.value_basis[b][s], h, q.device))
                for (b, h), ss in spans.items()
                for s in ss
            }

        pending = _executor().submit(fetch) if self.fetch == "thread" and pairs else None
        copy_stream = _copy_stream(q.device) if self.fetch == "stream" and pairs and q.is_cuda else None
        factors = None
        if copy_stream is not None:  # issued before Stage 1: the copies run beside its kernels
            copy_stream.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(copy_stream):
                factors = fetch()
        # Stage 1 (overlaps the fetch): the resident entries where they are held (no concatenation with the
        # coarse entries: that copied the whole resident cache every step), then the coarse entries of the alive
        # spans with bias log|S|, -inf where the span is expanded (by index, from the host's choice: no copy of a
        # host mask to the device) or gone
        resident_bias = None if base.bias_free else base.logit_bias
        parts = [biased_attention_splits(base.keys, base.values, resident_bias, q, scale)]
        B, Hq, Q = q.shape[0], q.shape[1], q.shape[2]
        M = sp.length.shape[1]
        if chosen:
            flat = from_host([(b * H + h) * M + s for b, h, s in chosen], bias_c.device)
            bias_c.view(-1).index_fill_(0, flat, float("-inf"))  # this step's own tensor (the routing launch's)
        parts.append(biased_attention_splits(sp.coarse_k, sp.coarse_v, bias_c, q, scale))
        if factors is None:
            factors = pending.result() if pending is not None else fetch()
        if copy_stream is not None:  # Stage 2 waits for the copies; the allocator keeps their memory until it ran
            compute = torch.cuda.current_stream(q.device)
            compute.wait_stream(copy_stream)
            for t in (t for kf, vf in factors.values() for t in (*kf, *vf)):
                t.record_stream(compute)
        if chosen:
            parts.append(self._stage2(q, scale, pairs, spans, factors))
            stats.fetched_bytes = sum(
                _head_bytes(sp.key_basis[b][s], h) + _head_bytes(sp.value_basis[b][s], h) for b, h, s in factors
            )
        self.last_step = stats
        # one softmax over all of it: every part merged by log-sum-exp in one pass
        out, lse = merge_splits(torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1))
        return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)

    def _stage2(self, q, scale, pairs, spans, factors) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 2 over the expanded spans from their factors as partial results for the merge: ``(outp [B·Hq·Q,
        n, D], lsep [B·Hq·Q, n])``, ``n`` the most spans a KV head expanded; each (span, KV head) item's query rows
        take the next free part of their head (``lse = -inf``, ``out = 0`` in the parts left free)."""
        B, Hq, Q, D = q.shape
        H = self._spans.alive.shape[1]
        g = Hq // H
        items = [(b, h, s) for b, h in pairs for s in spans[b, h]]
        n = max(len(ss) for ss in spans.values())
        slot = [i for b, h in pairs for i in range(len(spans[b, h]))]
        dev = q.device
        group = from_host([b * H + h for b, h, _ in items], dev)
        qi = q.float().reshape(B * H, g, Q, D).index_select(0, group)  # [P, g, Q, D]: each item's query heads
        out2, lse2 = factored_items(qi, [factors[i][0] for i in items], [factors[i][1] for i in items], scale)
        # row (b, h, j, q) of the merge is ((b·H + h)·g·Q + j·Q + q); item p's part is slot[p] of those rows
        rows = from_host(
            [((b * H + h) * g * Q + m) * n + k for (b, h, _), k in zip(items, slot) for m in range(g * Q)], dev
        )
        outp = torch.zeros(B * Hq * Q * n, D, dtype=torch.float32, device=dev)
        lsep = torch.full((B * Hq * Q * n,), float("-inf"), dtype=torch.float32, device=dev)
        outp.index_copy_(0, rows, out2.reshape(-1, D))
        lsep.index_copy_(0, rows, lse2.reshape(-1))
        return outp.view(B * Hq * Q, n, D), lsep.view(B * Hq * Q, n)

    # -- protocol bookkeeping ------------------------------------------------------------------------------------
    def tiers(self) -> Plan:
        """``FULL`` for every entry of ``read()`` (resident tokens and coarse span entries), ``EVICT`` on padding."""
        view = self.read()
        return Plan(torch.where(view.positions >= 0, FULL, EVICT).to(torch.uint8))

    def retier(self, plan: Plan) -> None:
        """Evict entries of ``read()``: resident tokens per head, and spans (a coarse entry) only in every KV head of
        their row at once; validated before anything changes."""
        view, kind, src = self._coarse_view(None)
        B, H, N = view.positions.shape
        if not isinstance(plan, Plan) or tuple(plan.key_bits.shape) != (B, H, N):
            raise ValueError(f"plan must be a kvcore.Plan laid out like read(): [B={B}, H={H}, T={N}]")
        for name, bits in (("key_bits", plan.key_bits), ("value_bits", plan.bits_for_values)):
            bits = bits.to(view.positions.device)
            if bool((bits[kind == 0] != EVICT).any()):
                raise ValueError(f"plan.{name} must be EVICT on padding")
            if bool(((bits != EVICT) & (bits != FULL))[kind > 0].any()):
                raise ValueError(f"plan.{name}: SEKVStore holds tiers {sorted(self.supported_bits)} and cannot demote")
        kb, vb = plan.key_bits.to(kind.device), plan.bits_for_values.to(kind.device)
        if bool((kb != vb)[kind == 2].any()):
            raise ValueError("a span's coarse key and value entries must be evicted together")
        dense_view = self._dense.read()
        Nd = dense_view.positions.shape[-1]
        dense_bits = torch.zeros(B, H, Nd, dtype=torch.uint8, device=kind.device)
        dense_vbits = torch.zeros_like(dense_bits)
        res = kind == 1
        bi, hi, _ = res.nonzero(as_tuple=True)
        dense_bits[bi, hi, src[res]] = kb[res]
        dense_vbits[bi, hi, src[res]] = vb[res]
        drop = None
        if self._spans is not None:
            sp = self._spans
            M = sp.length.shape[1]
            evict = torch.zeros(B, H, M, dtype=torch.bool, device=kind.device)
            co = kind == 2
            bi, hi, _ = co.nonzero(as_tuple=True)
            evict[bi, hi, src[co]] = kb[co] == EVICT
            partial = (evict.any(1) & ~evict.all(1)) & (sp.length > 0)
            if bool(partial.any()):
                raise ValueError(
                    "SEKVStore evicts a span in every KV head of its row at once (a span's bases are "
                    "shared by the heads); the plan evicts some heads only"
                )
            drop = evict.all(1) & (sp.length > 0)
        self._dense.retier(Plan(dense_bits, dense_vbits))
        if self._spans is not None:  # decoded tokens may have been evicted: counted again when asked
            self._spans.decoded = None
        if drop is not None and bool(drop.any()):
            self._drop_spans(drop)

    def _drop_spans(self, drop: torch.Tensor) -> None:
        """Remove spans ``drop`` ``[B, M]`` (their coarse entries, summaries and CPU bases)."""
        sp = self._spans
        B, _M = drop.shape
        keep = [[s for s in range(int((sp.length[b] > 0).sum())) if not bool(drop[b, s])] for b in range(B)]
        M2 = max((len(k) for k in keep), default=0)
        if M2 == 0:
            self._spans = None
            return
        idx = torch.zeros(B, M2, dtype=torch.long, device=sp.length.device)
        ok = torch.zeros(B, M2, dtype=torch.bool, device=sp.length.device)
        for b, k in enumerate(keep):
            idx[b, : len(k)] = torch.tensor(k, dtype=torch.long)
            ok[b, : len(k)] = True
        take = lambda t, dims: t.gather(2 if dims == 4 else 1, _expand_index(idx, t, dims))  # noqa: E731
        self._spans = _Spans(
            torch.where(ok, sp.length.gather(1, idx), 0),
            torch.where(ok, sp.last_pos.gather(1, idx), -1),
            take(sp.alive, 3) & ok[:, None, :],
            take(sp.coarse_k, 4) * ok[:, None, :, None],
            take(sp.coarse_v, 4) * ok[:, None, :, None],
            take(sp.summary, 4) * ok[:, None, :, None],
            [[sp.token_pos[b][s] for s in k] for b, k in enumerate(keep)],
            [[sp.key_basis[b][s] for s in k] for b, k in enumerate(keep)],
            [[sp.value_basis[b][s] for s in k] for b, k in enumerate(keep)],
            sp.capacity,
            sp.prefill_last,
            sp.budget,
        )

    def seq_lengths(self) -> torch.Tensor:
        """``[B, Hkv]`` entries of ``read()``: resident tokens plus one coarse entry per span."""
        lens = self._dense.seq_lengths()
        if self._spans is not None:
            lens = lens + self._spans.alive.sum(-1).to(lens.device)
        return lens

    def crop(self, position: int) -> None:
        """Drop entries at true position ``>= position``; a span whose last token is cropped is dropped whole."""
        position = check_int("position", position, low=0)
        self._dense.crop(position)
        if self._spans is not None:
            self._spans.decoded = None
            drop = (self._spans.last_pos >= position) & (self._spans.length > 0)
            if bool(drop.any()):
                self._drop_spans(drop)

    def reorder(self, index: torch.Tensor) -> None:
        """Batch rows ``index`` (beam search); validated by the resident store before anything changes."""
        self._dense.reorder(index)
        if self._spans is not None:
            sp = self._spans
            i = index.to(sp.length.device).long()
            rows = i.tolist()
            self._spans = _Spans(
                sp.length[i],
                sp.last_pos[i],
                sp.alive[i],
                sp.coarse_k[i],
                sp.coarse_v[i],
                sp.summary[i],
                [sp.token_pos[r] for r in rows],
                [sp.key_basis[r] for r in rows],
                [sp.value_basis[r] for r in rows],
                [sp.capacity[r] for r in rows],
                [sp.prefill_last[r] for r in rows],
                sp.budget,
            )


def _head_bytes(basis: SpanBasis, h: int) -> int:
    """Bytes of KV head ``h``'s part of a span basis (what is moved to the accelerator, Eq. 20)."""
    return sum(t[h].numel() * t.element_size() for t in basis.tensors())


_EXECUTOR: list = []


def _executor():
    """One shared worker thread for the asynchronous fetch (created on first use)."""
    if not _EXECUTOR:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-sekv-fetch"))
    return _EXECUTOR[0]


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device):
    """One CUDA stream per device for the factors' copies (created on first use)."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def _expand_index(idx: torch.Tensor, t: torch.Tensor, dims: int) -> torch.Tensor:
    if dims == 3:
        return idx[:, None, :].expand(t.shape[0], t.shape[1], idx.shape[1])
    return idx[:, None, :, None].expand(t.shape[0], t.shape[1], idx.shape[1], t.shape[3])


@functools.lru_cache(maxsize=16)
def _identity(D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 [D], I [D, D])``: the factors ``σ, Vᵀ`` of a raw span (shared, never written)."""
    return torch.ones(D, device=device), torch.eye(D, device=device)


def _factors(basis: SpanBasis, h: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U, σ, Vᵀ)`` of head ``h`` on ``device``; a raw span is ``(X, 1, I)``."""
    if basis.raw is not None:
        x = basis.raw[h].to(device, non_blocking=True)
        return (x, *_identity(x.shape[-1], x.device))
    return tuple(t[h].to(device, non_blocking=True) for t in (basis.U, basis.sigma, basis.Vh))


def _sorted(keys, values, pos, bias, kind, src):
    """Sort entries by position per head (padding last) and trim trailing padding."""
    big = torch.iinfo(torch.long).max
    order = torch.argsort(torch.where(pos >= 0, pos, big), dim=-1, stable=True)
    n = int((pos >= 0).sum(-1).max()) if pos.numel() else 0
    order = order[..., :n]
    D = keys.shape[-1]
    oi = order[..., None].expand(*order.shape, D)
    k, v = keys.gather(2, oi), values.gather(2, oi)
    p, bb = pos.gather(2, order), bias.gather(2, order)
    valid = p >= 0
    k, v = k.masked_fill(~valid[..., None], 0), v.masked_fill(~valid[..., None], 0)
    bb = bb.masked_fill(~valid, float("-inf"))
    return KVView(k, v, p, bb.float()), torch.where(valid, kind.gather(2, order), 0), src.gather(2, order)
