"""Scheduler-side bookkeeping of the connector, free of vLLM types (unit-testable on its own).

vLLM's scheduler asks the connector how many prompt tokens beyond its own prefix cache it can supply
(:meth:`SchedulerState.lookup`, side-effect free), tells it which blocks it allocated
(:meth:`SchedulerState.after_alloc`), and once per step asks for the metadata the workers act on
(:meth:`SchedulerState.build`): blocks to load (decode + scatter before the forward pass) and blocks to save
(gather + encode after each layer's attention). The workers report back which entries they stored, which loads
failed, and which entries left the store (evicted, found corrupt, vanished) (:meth:`SchedulerState.on_worker_report`);
that report is the scheduler's index of what the store holds, because the store lives in the worker process.

A lookup therefore offers only entries the workers last reported as held. What can still go wrong between a lookup
and the load (an entry evicted by the same step's saves, a file deleted or damaged on disk, an I/O error) is reported
by the worker as failed blocks, which vLLM recomputes: the connector requires ``kv_load_failure_policy: "recompute"``.

Keys come from vLLM's own block hashes (:func:`kv_vllm.keys.request_keys`), so a request is identified the way vLLM's
prefix cache identifies it (tokens, LoRA, multimodal inputs, ``cache_salt``, prompt embeddings). A request without
block hashes is neither offered a hit nor saved, and counted in ``metrics.unhashed_requests``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvcore.checks import check_int

from .keys import request_keys


@dataclass(frozen=True)
class BlockTransfer:
    """One block to move between vLLM's paged cache and the store: its cache key and vLLM block id."""

    key: str
    block_id: int


@dataclass
class StepPlan:
    """What the workers do in one engine step.

    ``loads`` maps a request id to its blocks to load, in token order (a failure at block ``i`` means blocks
    ``i..`` of that request are reported failed: vLLM recomputes from the first one). ``saves`` lists blocks to
    store, each key once. ``reset`` asks the workers to drop every entry first (vLLM's ``reset_cache``).
    """

    loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)
    saves: list[BlockTransfer] = field(default_factory=list)
    reset: bool = False

    def is_empty(self) -> bool:
        return not self.loads and not self.saves and not self.reset


@dataclass
class _Request:
    keys: list[str]  # keys of the full *prompt* blocks that may be stored (empty when the request has no hashes)
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # prompt blocks already considered for saving


@dataclass
class SchedulerMetrics:
    """Prefix lookups as the scheduler sees them.

    ``lookup_tokens`` / ``hit_tokens``: prompt tokens allocated and tokens offered from the store (counted once per
    allocation); ``save_blocks`` / ``load_blocks``: blocks planned; ``failed_blocks``: planned loads the workers
    reported failed (recomputed by vLLM); ``evicted_blocks``: entries the workers reported gone from the store;
    ``unhashed_requests``: requests refused because vLLM gave them no block hashes.
    """

    lookup_tokens: int = 0
    hit_tokens: int = 0
    save_blocks: int = 0
    load_blocks: int = 0
    failed_blocks: int = 0
    evicted_blocks: int = 0
    unhashed_requests: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class SchedulerState:
    """Block-aligned prefix lookup, load and save planning, and the index of stored entries.

    Parameters
    ----------
    namespace : Mapping[str, str]
        Key namespace (:func:`kv_vllm.keys.namespace`).
    block_size : int
        Tokens per vLLM KV block.
    hashes_per_block : int
        vLLM block hashes per KV block (``block_size // hash_block_size``; 1 unless vLLM hashes at a finer grain).
    """

    def __init__(self, namespace: Mapping[str, str], block_size: int, hashes_per_block: int = 1):
        self.namespace = dict(namespace)
        self.block_size = check_int("block_size", block_size, low=1)
        self.hashes_per_block = check_int("hashes_per_block", hashes_per_block, low=1)
        self.index: set[str] = set()
        self.metrics = SchedulerMetrics()
        self._requests: dict[str, _Request] = {}
        self._pending_loads: dict[str, list[BlockTransfer]] = {}
        self._reset = False

    # ------------------------------------------------------------------------------------------- lookup
    def prompt_keys(self, block_hashes: Sequence[bytes], num_prompt_tokens: int) -> list[str] | None:
        """Keys of the prompt's blocks that may be supplied: full blocks, leaving at least the last token.

        vLLM must compute at least one prompt token itself (to sample from its logits), so a prompt of exactly
        ``k`` blocks offers only ``k - 1`` of them. None when vLLM gave the request too few block hashes.
        """
        check_int("num_prompt_tokens", num_prompt_tokens, low=0)
        usable = max(num_prompt_tokens - 1, 0) // self.block_size
        return request_keys(self.namespace, block_hashes, usable, self.hashes_per_block)

    def _run(self, keys: Sequence[str]) -> int:
        run = 0
        while run < len(keys) and keys[run] in self.index:
            run += 1
        return run

    def lookup(self, block_hashes: Sequence[bytes], num_prompt_tokens: int, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the store can supply (a multiple of the block size, maybe 0).

        Counts the leading run of the prompt's block keys present in the index. No side effects: vLLM may call
        it any number of times for the same request.
        """
        check_int("num_computed_tokens", num_computed_tokens, low=0)
        if num_computed_tokens % self.block_size:
            return 0  # vLLM's local hits are whole blocks; anything else is not ours to extend
        keys = self.prompt_keys(block_hashes, num_prompt_tokens)
        if not keys:
            return 0
        return max(self._run(keys) * self.block_size - num_computed_tokens, 0)

    # ---------------------------------------------------------------------------------------- allocation
    def after_alloc(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_prompt_tokens: int,
        block_ids: Sequence[int],
        num_external_tokens: int,
    ) -> None:
        """Record the blocks vLLM allocated; plan the load of ``num_external_tokens`` tokens into them.

        ``block_ids`` are all of the request's blocks (vLLM's local prefix hits first). The external tokens are
        the ones :meth:`lookup` offered: they end where the leading run of indexed blocks ends, so the load covers
        blocks ``run - num_external_tokens / block_size`` up to ``run``.
        """
        check_int("num_external_tokens", num_external_tokens, low=0)
        req = self._track(request_id, block_hashes, num_prompt_tokens)
        req.block_ids = list(block_ids)
        self.metrics.lookup_tokens += num_prompt_tokens
        if num_external_tokens == 0:
            return
        keys = self.prompt_keys(block_hashes, num_prompt_tokens) or []
        run = self._run(keys)
        if num_external_tokens % self.block_size or num_external_tokens > run * self.block_size:
            raise ValueError(
                f"request {request_id}: cannot load {num_external_tokens} tokens: the store offers {run} whole "
                f"blocks of {self.block_size} tokens"
            )
        first = run - num_external_tokens // self.block_size
        if run > len(req.block_ids):
            raise ValueError(f"request {request_id}: {run} blocks to fill but only {len(req.block_ids)} allocated")
        self._pending_loads[request_id] = [BlockTransfer(keys[i], req.block_ids[i]) for i in range(first, run)]
        self.metrics.hit_tokens += num_external_tokens
        req.saved_upto = max(req.saved_upto, run)  # blocks before run are local hits or loaded: stored already

    # ---------------------------------------------------------------------------------------------- steps
    def build(
        self,
        new_requests: Sequence[tuple[str, Sequence[int], int, int]],
        cached_requests: Sequence[tuple[str, Sequence[int] | None, bool, int, int]],
    ) -> StepPlan:
        """Plan one step; resets the pending loads.

        Parameters
        ----------
        new_requests : sequence of (request_id, block_ids, num_computed_tokens, num_scheduled)
            Requests scheduled for the first time (``block_ids`` all of their blocks; their keys were recorded by
            :meth:`after_alloc`).
        cached_requests : sequence of (request_id, new_block_ids or None, resumed, num_computed_tokens,
            num_scheduled)
            Requests already running; ``new_block_ids`` are appended, or replace the list when ``resumed`` after
            preemption (vLLM then sends all of them).
        """
        plan = StepPlan(reset=self._reset)
        self._reset = False
        planned: set[str] = set()
        for request_id, block_ids, computed, scheduled in new_requests:
            req = self._requests.get(request_id)
            if req is None:
                continue  # never allocated through after_alloc: nothing known to key it by
            req.block_ids = list(block_ids)
            self._plan_saves(req, computed + scheduled, plan, planned)
        for request_id, new_block_ids, resumed, computed, scheduled in cached_requests:
            req = self._requests.get(request_id)
            if req is None:
                continue
            if resumed:
                req.block_ids = list(new_block_ids or [])
            elif new_block_ids:
                req.block_ids.extend(new_block_ids)
            self._plan_saves(req, computed + scheduled, plan, planned)
        for request_id, transfers in self._pending_loads.items():
            plan.loads[request_id] = transfers
            self.metrics.load_blocks += len(transfers)
        self._pending_loads = {}
        self.metrics.save_blocks += len(plan.saves)
        return plan

    def _plan_saves(self, req: _Request, computed_after: int, plan: StepPlan, planned: set[str]) -> None:
        full = min(computed_after // self.block_size, len(req.keys), len(req.block_ids))
        for i in range(req.saved_upto, full):
            key = req.keys[i]
            if key not in self.index and key not in planned:
                plan.saves.append(BlockTransfer(key, req.block_ids[i]))
                planned.add(key)
        req.saved_upto = max(req.saved_upto, full)

    def _track(self, request_id: str, block_hashes: Sequence[bytes], num_prompt_tokens: int) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            full = num_prompt_tokens // self.block_size
            keys = request_keys(self.namespace, block_hashes, full, self.hashes_per_block)
            if keys is None:  # no hashes from vLLM: refuse to key this request by anything else
                self.metrics.unhashed_requests += 1
                keys = []
            req = _Request(keys)
            self._requests[request_id] = req
        return req

    # -------------------------------------------------------------------------------------- worker report
    def on_worker_report(self, stored: Sequence[str], failed: Sequence[str], evicted: Sequence[str] = ()) -> None:
        """Apply a worker report: index what it stored, forget what failed to load and what left the store.

        ``failed`` are planned loads that found no usable entry (vLLM recomputes those blocks); ``evicted`` are
        entries that left the store without a load noticing (evicted for room, deleted, found gone on disk).
        """
        self.index.update(stored)
        self.index.difference_update(failed)
        self.index.difference_update(evicted)
        self.metrics.failed_blocks += len(failed)
        self.metrics.evicted_blocks += len(evicted)
        if failed:  # vLLM recomputes the failed blocks of running requests: save them again when it does
            gone = set(failed)
            for req in self._requests.values():
                for i in range(min(req.saved_upto, len(req.keys))):
                    if req.keys[i] in gone:
                        req.saved_upto = i
                        break

    def reset(self) -> None:
        """Forget every indexed entry and tell the workers (next step's plan) to drop their stores."""
        self.index.clear()
        self._reset = True
        for req in self._requests.values():
            req.saved_upto = 0

    def finished(self, request_id: str) -> None:
        """Forget a finished request (its saves happened synchronously in its steps)."""
        self._requests.pop(request_id, None)
        self._pending_loads.pop(request_id, None)

    @property
    def tracked_requests(self) -> int:
        return len(self._requests)
