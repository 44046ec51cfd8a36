"""Batch > 1 with left padding: padding is never kept, positions are per row, rows equal unbatched runs."""

import pytest
import torch
from kvhf_testkit import KnormScorer, WindowScorer, make, prompt, tiny_model

import kv_hf
from kvcore import Budget, Protection

LENGTHS = (18, 11, 14)


def _batch():
    rows = [prompt(n, seed=20 + i)[0] for i, n in enumerate(LENGTHS)]
    T = max(LENGTHS)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    return rows, ids, mask


@pytest.mark.parametrize(
    "compressor",
    [
        make(KnormScorer(), ratio=0.5),
        make(WindowScorer(), ratio=0.4, protect=Protection(sinks=2, recent=3)),
        make(KnormScorer(), ratio=0.5, granularity="layer"),
    ],
    ids=["knorm-head", "window-head", "knorm-layer"],
)
@torch.no_grad()
def test_left_padded_batch_rows_equal_unbatched_runs(compressor):
    model = tiny_model("llama")
    rows, ids, mask = _batch()
    cache = kv_hf.compressed_cache(model, compressor, query_window=8)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        past_key_values=cache,
        output_scores=True,
        return_dict_in_generate=True,
    )
    T = ids.shape[1]
    assert cache.get_seq_length() == T + 5
    assert cache.next_positions().tolist() == [n + 5 for n in LENGTHS]
    for i, row in enumerate(rows):
        single = kv_hf.compressed_cache(model, compressor, query_window=8)
        ref = model.generate(
            row[None],
            max_new_tokens=6,
            do_sample=False,
            past_key_values=single,
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences[i, T:], ref.sequences[0, len(row) :])
        for got, want in zip(out.scores, ref.scores):
            torch.testing.assert_close(got[i], want[0], rtol=0, atol=1e-5)
        kept = Budget(ratio=compressor.budget.ratio).kept(len(row))
        for layer, ref_layer in zip(cache.layers, single.layers):
            view, ref_view = layer.store.read(), ref_layer.store.read()
            n = int(layer.store.seq_lengths()[i].sum())
            assert n == int(ref_layer.store.seq_lengths()[0].sum()) == layer.store.seq_lengths().shape[1] * (kept + 5)
            pos = view.positions[i]
            real = pos[pos >= 0]
            assert bool((real < len(row) + 5).all())  # true positions of the row, padding never kept
            assert sorted(real.tolist()) == sorted(ref_view.positions[0][ref_view.positions[0] >= 0].tolist())
