"""kvbench's measurements: peak memory of a block (allocator reuse must not hide it) and compression time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import kv_hf
from kv_hf.testing import tiny_model
from kvbench.memory import peak_memory, release_free_memory
from kvbench.run import decode_rate
from kvcore import Budget, Compressor, DenseStore, Scorer, Scores, ScoringContext, TopKSelector


def prompt(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(seed))


class _KeyNorm(Scorer):
    """Keep low-norm keys (kvpress Knorm), so compression really evicts."""

    def score(self, ctx: ScoringContext) -> Scores:
        return Scores(-ctx.keys.float().norm(dim=-1))


def knorm_half() -> Compressor:
    return Compressor(_KeyNorm(), TopKSelector(), DenseStore, Budget(ratio=0.5))


MIB = 2**20
LINUX_PEAK = Path("/proc/self/clear_refs").exists()


def _allocate(chunks: int = 8, mib: int = 16) -> None:
    held = [torch.ones(mib * MIB // 4) for _ in range(chunks)]  # ones: pages are touched, so they are resident
    assert sum(t.numel() for t in held) * 4 == chunks * mib * MIB


@pytest.mark.skipif(not LINUX_PEAK, reason="peak RSS needs Linux /proc/self/clear_refs (None elsewhere: next test)")
def test_repeated_blocks_each_report_their_peak():
    # 16 MiB chunks: after the first round glibc raises its mmap threshold, so later rounds come from the heap
    # and, without trimming, would reuse resident pages and read ~0.
    peaks = []
    for _ in range(3):
        with peak_memory("cpu") as peak:
            _allocate()
        peaks.append(peak.bytes)
    assert all(p is not None and p >= 0.9 * 128 * MIB for p in peaks), [p / MIB for p in peaks]


@pytest.mark.skipif(LINUX_PEAK, reason="platforms without /proc/self/clear_refs only")
def test_peak_is_unknown_without_linux_counters():
    with peak_memory("cpu") as peak:
        _allocate(1, 1)
    assert peak.bytes is None


def test_release_free_memory_reports_whether_it_could():
    assert isinstance(release_free_memory(), bool)


@torch.no_grad()
def test_compress_seconds_counts_compression_only_and_nested_blocks_once():
    model = tiny_model()
    cache = kv_hf.compressed_cache(model, knorm_half())
    assert cache.compress_seconds == 0.0
    t0 = time.perf_counter()
    kv_hf.prefill(model, cache, prompt(64))
    wall = time.perf_counter() - t0
    first = cache.compress_seconds
    assert 0.0 < first < wall
    model(prompt(1, seed=3), past_key_values=cache)  # a decode step compresses nothing
    assert cache.compress_seconds == first
    with cache.timed(), cache.timed():
        time.sleep(0.05)
    assert 0.05 <= cache.compress_seconds - first < 0.1


@torch.no_grad()
def test_decode_rate_times_steps_and_leaves_the_cache_as_it_was():
    model = tiny_model()
    cache = kv_hf.compressed_cache(model, knorm_half())
    last = kv_hf.prefill(model, cache, prompt(40))
    probe = prompt(1, seed=5)
    expected = model(probe, past_key_values=cache, position_ids=torch.tensor([[40]])).logits
    cache.rollback(40)  # the Stores keep their append slack (held, counted): compare after one append
    before = (cache.get_seq_length(), cache.nbytes(), [n.clone() for n in cache.seq_lengths()])
    assert decode_rate(model, cache, last.argmax(-1), steps=3) > 0
    assert (cache.get_seq_length(), cache.nbytes()) == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(cache.seq_lengths(), before[2]))
    again = model(probe, past_key_values=cache, position_ids=torch.tensor([[40]])).logits
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        decode_rate(model, cache, last.argmax(-1), steps=0)


@torch.no_grad()
def test_decode_rate_restores_the_sliding_windows_of_a_hybrid_model():
    # Gemma 3's sliding-window layers (8 tokens here) slide during the timed steps: they must come back exactly
    model = tiny_model("gemma3")
    cache = kv_hf.compressed_cache(model, knorm_half())
    last = kv_hf.prefill(model, cache, prompt(40))
    probe = prompt(1, seed=5)
    with cache.held():
        expected = model(probe, past_key_values=cache, position_ids=torch.tensor([[40]])).logits
        cache.rollback(40)
    windows = [(w.keys.clone(), w.values.clone()) for w in cache.windows]
    assert decode_rate(model, cache, last.argmax(-1), steps=12) > 0
    assert cache.get_seq_length() == 40
    for w, (k, v) in zip(cache.windows, windows):
        assert torch.equal(w.keys, k) and torch.equal(w.values, v)
    again = model(probe, past_key_values=cache, position_ids=torch.tensor([[40]])).logits
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
