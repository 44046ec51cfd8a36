"""SentenceKV's cache: the kept entries, their sentences, and a per-step attention set retrieved by sentence."""

from __future__ import annotations

import torch

from kv_baselines.sentence.plan import SentencePlan
from kvcore import DenseStore, KVView, Plan
from kvcore.checks import check_int, check_number
from kvcore.memory import storage_bytes


class SentenceKVStore(DenseStore):
    """A :class:`kvcore.DenseStore` whose ``read(query)`` attends to a sentence-level retrieved subset (SentenceKV,
    Zhu et al. 2025, §3, decoding stage; the authors' ``custom_llama_sentencekv.py``).

    ``write`` keeps what the plan keeps and, from a :class:`SentencePlan`, the sentence of every kept token (a plain
    plan puts a row's whole prompt in one sentence). Entries appended later (decoded tokens) form one more sentence
    per row. ``read(query)`` computes each sentence's semantic vector, the mean of its held keys in each KV head, and
    lets the query attend to

    * the first ``sinks`` and the last ``recent`` entries each head holds (the authors' start and recent budgets);
    * then the entries of the sentences whose semantic vector has the largest dot product with the query (the mean
      of the query over its GQA group and its rows), sentence after sentence in that order, up to
      ``floor(n / semantic_factor) - sinks - recent`` entries per head, where ``n`` is what the head held after
      ``write`` (the authors keep ``semantic_factor`` times the decode token budget at prefill).

    The other entries get a ``-inf`` logit bias in that view. ``read()`` without a query is the whole cache.

    Parameters
    ----------
    sinks : int
        Leading held entries every step attends to (``start_budget``, 32 in the authors' code).
    recent : int
        Trailing held entries every step attends to (``recent_budget``, 32).
    semantic_factor : float
        Held entries per entry attended (``semantic_factor``, 5): the per-step token budget is ``n / semantic_factor``.
    growth : int
        :class:`kvcore.DenseStore`'s append reserve.

    Notes
    -----
    Departures from the authors' code: the retrieval query is the current step's query, not the running mean of the
    queries of the sentence being decoded (the store sees no token ids while decoding, so it cannot tell where a
    decoded sentence ends), and for the same reason the first token of a decoded sentence does not attend to the
    whole cache, and all decoded tokens form one sentence; the selection is per KV head (the authors select per
    query head after ``repeat_kv``); every entry stays resident — the paper offloads the token entries to host
    memory and keeps only the semantic vectors on the accelerator, so ``nbytes`` here counts every held entry.
    """

    query_dependent = True

    def __init__(self, sinks: int = 32, recent: int = 32, semantic_factor: float = 5.0, growth: int = 64) -> None:
        self.sinks = check_int("sinks", sinks, low=0)
        self.recent = check_int("recent", recent, low=0)
        self.semantic_factor = check_number("semantic_factor", semantic_factor, low=1.0)
        self.growth = check_int("growth", growth, low=0)
        super().__init__(growth)

    # -- state -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        # the sentence id of every held entry, in a shadow store laid out like this one (one float32 channel), so
        # that every mutation moves the ids with their entries and evicted entries hold nothing
        self._ids = DenseStore(self.growth)
        self._limit: torch.Tensor | None = None  # int64 [B, H]: retrieved entries per head per step
        self._decoded: torch.Tensor | None = None  # int64 [B]: the sentence id of appended entries

    def nbytes(self, device: torch.device | str | None = None) -> int:
        return super().nbytes(device) + self._ids.nbytes(device) + storage_bytes([self._limit, self._decoded], device)

    @staticmethod
    def _channel(ids: torch.Tensor, H: int) -> torch.Tensor:
        """``[B, T]`` ids as the shadow store's ``[B, H, T, 1]`` float32 entries (exact below 2**24)."""
        return ids.float()[:, None, :, None].expand(-1, H, -1, 1).contiguous()

    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """:meth:`kvcore.DenseStore.write`, then the kept tokens' sentences (from a :class:`SentencePlan`)."""
        super().write(keys, values, plan, positions)
        B, H, T = plan.key_bits.shape
        device = keys.device
        sid = plan.sentence_id if isinstance(plan, SentencePlan) else torch.zeros(B, T, dtype=torch.long)
        sid = sid.to(device)
        keep = plan.keep_keys.to(device)
        ids = self._channel(sid, H)
        self._ids.write(ids, ids, Plan.from_keep(keep), positions)
        self._decoded = torch.where(keep.any(1), sid, -1).amax(-1) + 1
        lens = self.seq_lengths().to(device)
        self._limit = (torch.floor(lens / self.semantic_factor).long() - self.sinks - self.recent).clamp(min=0)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """:meth:`kvcore.DenseStore.append`; the appended entries join the row's decoded sentence."""
        super().append(keys, values, positions)
        B, H, n, _ = keys.shape
        if self._decoded is None:
            self._decoded = torch.zeros(B, dtype=torch.long, device=keys.device)
        ids = self._channel(self._decoded[:, None].expand(B, n), H)
        self._ids.append(ids, ids, positions)

    def retier(self, plan: Plan) -> None:
        super().retier(plan)
        self._ids.retier(Plan.from_keep(plan.keep_keys))

    def crop(self, position: int) -> None:
        super().crop(position)
        self._ids.crop(position)

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        self._ids.reorder(index)
        if self._decoded is not None:
            index = index.to(self._decoded.device).long()
            self._decoded = self._decoded[index]
            self._limit = None if self._limit is None else self._limit[index]

    # -- retrieval ---------------------------------------------------------------------------------------
    def sentences(self) -> torch.Tensor:
        """``[B, H, T]`` int64 sentence id of every held entry, laid out like :meth:`read` (``-1`` for padding)."""
        view = self._ids.read()
        return torch.where(view.valid, view.keys[..., 0].long(), -1)

    def retrieve(self, view: KVView, query: torch.Tensor) -> torch.Tensor:
        """``[B, H, T]`` bool: the entries of ``view`` the step of ``query`` (``[B, Hq, Q, D]``) attends to."""
        B, H, T, D = view.keys.shape
        valid = view.valid
        sid = self.sentences()
        S = int(sid.max()) + 1 if T else 0
        k = view.keys.float()
        slot = torch.where(valid, sid, S)  # padding into a spare slot
        sums = torch.zeros(B, H, S + 1, D, device=k.device).scatter_add_(2, slot[..., None].expand(B, H, T, D), k)
        counts = torch.zeros(B, H, S + 1, device=k.device).scatter_add_(2, slot, valid.float())
        means = sums[:, :, :S] / counts[:, :, :S, None].clamp(min=1.0)
        q = query.float().mean(2).view(B, H, -1, D).mean(2)  # [B, H, D]
        sim = torch.einsum("bhsd,bhd->bhs", means, q).masked_fill(counts[:, :, :S] == 0, float("-inf"))
        order = torch.sort(sim, dim=-1, descending=True, stable=True).indices
        rank_of = torch.empty_like(order).scatter_(-1, order, torch.arange(S, device=k.device).expand_as(order))
        n = valid.sum(-1, keepdim=True)
        index = torch.arange(T, device=k.device).expand(B, H, T)
        fixed = valid & ((index < self.sinks) | (index >= n - self.recent))
        free = valid & ~fixed
        rank = torch.where(free, rank_of.gather(-1, slot.clamp(max=max(S - 1, 0))), S)
        key = rank * T + index  # sentence rank first, then position in the cache
        pick = torch.argsort(torch.argsort(key, dim=-1, stable=True), dim=-1, stable=True)
        chosen = free & (pick < self._limit.to(k.device)[..., None])
        return fixed | chosen

    def read(self, query: torch.Tensor | None = None) -> KVView:
        """The whole cache without ``query``; with it, the same view with ``-inf`` bias on the entries not retrieved."""
        view = super().read()
        if query is None or self._limit is None:
            return view
        if not isinstance(query, torch.Tensor) or query.ndim != 4 or query.shape[-1] != view.keys.shape[-1]:
            got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            raise ValueError(f"query must be [B, Hq, Q, D={view.keys.shape[-1]}], got {got}")
        attend = self.retrieve(view, query)
        bias = torch.where(attend, view.logit_bias.expand(attend.shape), float("-inf"))
        return KVView(view.keys, view.values, view.positions, bias)
