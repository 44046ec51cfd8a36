"""Scheduler-side planning without vLLM: lookup, load planning, save planning, the worker-reported index."""

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_vllm import SchedulerState, namespace, request_keys

sys.path.insert(0, str(Path(__file__).parent))
from block_hashing import block_hashes

N = 4
NS = namespace(model="m@", dtype="float16", num_kv_heads=1, head_size=8, block_size=N, codec_hash="0" * 32)


def H(prompt, extra=None):
    return block_hashes(prompt, N, extra)


def block_keys(prompt, extra=None):
    hashes = H(prompt, extra)
    return request_keys(NS, hashes, len(hashes))


def state_with(prompt, stored_blocks):
    s = SchedulerState(NS, N)
    s.on_worker_report(block_keys(prompt)[:stored_blocks], [])
    return s


class Sched:
    """The tests' shorthand: a SchedulerState called the way the connector calls it, from token ids."""

    def __init__(self, state):
        self.s = state

    def lookup(self, prompt, computed, extra=None):
        return self.s.lookup(H(prompt, extra), len(prompt), computed)

    def after_alloc(self, rid, prompt, blocks, external, extra=None):
        return self.s.after_alloc(rid, H(prompt, extra), len(prompt), blocks, external)


def test_lookup_counts_the_leading_run_and_keeps_one_token():
    prompt = list(range(13))  # 3 full blocks + 1 token
    s = state_with(prompt, 3)
    t = Sched(s)
    assert t.lookup(prompt, 0) == 12
    assert t.lookup(prompt, 4) == 8  # beyond vLLM's own local hit
    assert t.lookup(prompt, 12) == 0
    assert t.lookup(prompt[:12], 0) == 8  # exactly 3 blocks: the last token must be computed, so 2 blocks
    assert t.lookup(prompt, 2) == 0  # a non block-aligned local hit is never extended
    s.on_worker_report([], [block_keys(prompt)[1]])  # a block found missing: the run stops before it
    assert t.lookup(prompt, 0) == 4
    s.on_worker_report([], [], [block_keys(prompt)[0]])  # an eviction the worker reported: no hit at all
    assert t.lookup(prompt, 0) == 0 and s.metrics.evicted_blocks == 1 and s.metrics.failed_blocks == 1


def test_lookup_has_no_side_effects():
    prompt = list(range(13))
    s = state_with(prompt, 3)
    first = [Sched(s).lookup(prompt, 0) for _ in range(3)]
    assert first == [12, 12, 12] and s.tracked_requests == 0 and s.metrics.lookup_tokens == 0


def test_load_plan_covers_the_external_blocks_into_the_allocated_ones():
    prompt = list(range(13))
    s = state_with(prompt, 3)
    keys = block_keys(prompt)
    Sched(s).after_alloc("r", prompt, [10, 11, 12, 13], 8)  # block 0 is a local hit
    plan = s.build([("r", [10, 11, 12, 13], 12, 1)], [])
    assert [(t.key, t.block_id) for t in plan.loads["r"]] == [(keys[1], 11), (keys[2], 12)]
    assert plan.saves == []  # every full block is already stored
    assert s.build([], []).is_empty()  # loads are handed out once
    with pytest.raises(ValueError, match="cannot load 12 tokens"):
        Sched(s).after_alloc("q", prompt[:9], [1, 2, 3], 12)


def test_saves_follow_chunked_prefill_and_skip_stored_blocks():
    prompt = list(range(18))  # 4 full blocks + 2 tokens
    s = SchedulerState(NS, N)
    keys = block_keys(prompt)
    Sched(s).after_alloc("r", prompt, [5, 6], 0)
    plan = s.build([("r", [5, 6], 0, 6)], [])  # first chunk: 6 tokens -> block 0 complete
    assert [(t.key, t.block_id) for t in plan.saves] == [(keys[0], 5)]
    plan = s.build([], [("r", [7, 8, 9], False, 6, 12)])  # second chunk completes blocks 1..3 (18 tokens)
    assert [(t.key, t.block_id) for t in plan.saves] == [(keys[1], 6), (keys[2], 7), (keys[3], 8)]
    assert s.build([], [("r", None, False, 18, 1)]).saves == []  # decode steps save nothing
    s.finished("r")
    assert s.tracked_requests == 0
    # a second request with the same prefix after the worker reported the saves: nothing to save again
    s.on_worker_report(keys, [])
    Sched(s).after_alloc("q", prompt, [1, 2, 3, 4, 9], 16)
    plan = s.build([("q", [1, 2, 3, 4, 9], 16, 2)], [])
    assert len(plan.loads["q"]) == 4 and plan.saves == []


def test_two_requests_in_one_step_save_a_shared_block_once():
    prompt = list(range(8))
    s = SchedulerState(NS, N)
    for rid, blocks in (("a", [1, 2]), ("b", [3, 4])):
        Sched(s).after_alloc(rid, prompt, blocks, 0)
    plan = s.build([("a", [1, 2], 0, 8), ("b", [3, 4], 0, 8)], [])
    assert [t.block_id for t in plan.saves] == [1, 2]


def test_resumed_request_replaces_its_blocks():
    prompt = list(range(12))
    s = SchedulerState(NS, N)
    Sched(s).after_alloc("r", prompt, [1], 0)
    s.build([("r", [1], 0, 4)], [])
    plan = s.build([], [("r", [7, 8, 9], True, 4, 8)])  # preempted, resumed with new blocks
    assert [t.block_id for t in plan.saves] == [8, 9]


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), min_size=0, max_size=30),
    b=st.lists(st.integers(0, 3), min_size=0, max_size=30),
    stored=st.integers(0, 8),
    computed_blocks=st.integers(0, 8),
)
def test_lookup_matches_a_token_comparison(a, b, stored, computed_blocks):
    """Invariant: after prompt ``a``'s first ``stored`` blocks are stored, prompt ``b`` is offered exactly the
    whole blocks it shares with them token for token, at most ``(len(b) - 1) // N`` blocks, minus vLLM's own hit."""
    s = SchedulerState(NS, N)
    s.on_worker_report(block_keys(a)[:stored], [])
    t = Sched(s)
    shared = 0
    while (
        shared < min(stored, len(a) // N, (len(b) - 1) // N if b else 0)
        and a[shared * N : (shared + 1) * N] == b[shared * N : (shared + 1) * N]
    ):
        shared += 1
    assert t.lookup(b, computed_blocks * N) == max(shared - computed_blocks, 0) * N


def test_isolation_same_tokens_other_tenant_gets_no_hit_and_no_load():
    """Two requests with identical token ids but a different cache_salt (or LoRA, or image): no hit across them."""
    prompt = list(range(13))
    s = SchedulerState(NS, N)
    t = Sched(s)
    t.after_alloc("a", prompt, [1, 2, 3, 4], 0, extra="salt-a")
    plan = s.build([("a", [1, 2, 3, 4], 0, 13)], [])
    s.on_worker_report([x.key for x in plan.saves], [])
    assert t.lookup(prompt, 0, extra="salt-a") == 12
    assert t.lookup(prompt, 0, extra="salt-b") == 0 and t.lookup(prompt, 0) == 0
    with pytest.raises(ValueError, match="cannot load 12 tokens"):
        t.after_alloc("b", prompt, [5, 6, 7, 8], 12, extra="salt-b")


def test_a_request_without_block_hashes_is_neither_offered_nor_saved():
    prompt = list(range(13))
    s = state_with(prompt, 3)
    assert s.lookup([], len(prompt), 0) == 0
    s.after_alloc("r", [], len(prompt), [1, 2, 3, 4], 0)
    assert s.build([("r", [1, 2, 3, 4], 0, 13)], []).saves == []
    assert s.metrics.unhashed_requests == 1


def test_reset_forgets_the_index_and_tells_the_workers_once():
    prompt = list(range(13))
    s = state_with(prompt, 3)
    s.reset()
    assert Sched(s).lookup(prompt, 0) == 0
    assert s.build([], []).reset and not s.build([], []).reset


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from(["store", "evict", "fail"]), st.integers(0, 5)), min_size=0, max_size=40)
)
def test_lookup_never_offers_a_block_the_worker_reported_gone(events):
    """Invariant: whatever the order of stored / evicted / failed reports, a lookup offers exactly the leading run
    of blocks whose last report was "stored" -- never one reported evicted or failed since."""
    prompt = list(range(6 * N + 1))
    keys = block_keys(prompt)
    s = SchedulerState(NS, N)
    held = set()
    for event, i in events:
        if event == "store":
            s.on_worker_report([keys[i]], [])
            held.add(i)
        elif event == "evict":
            s.on_worker_report([], [], [keys[i]])
            held.discard(i)
        else:
            s.on_worker_report([], [keys[i]])
            held.discard(i)
    run = 0
    while run in held:
        run += 1
    assert Sched(s).lookup(prompt, 0) == run * N
