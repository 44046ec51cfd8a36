"""Query-agnostic reuse: one compressed context, several questions, each answer rolled back (kvpress pipeline)."""

import pytest
import torch
from kvhf_testkit import CharTokenizer, KnormScorer, WindowScorer, make, prompt, tiny_model

import kv_hf
from kvcore import Protection

QUESTIONS = [prompt(5, seed=40)[0], prompt(9, seed=41)[0], prompt(3, seed=42)[0]]


def _state(cache):
    return [(v.keys.clone(), v.positions.clone()) for v in (layer.store.read() for layer in cache.layers)]


@pytest.mark.parametrize(
    "compressor",
    [make(KnormScorer(), ratio=0.5), make(WindowScorer(), ratio=0.6, protect=Protection(sinks=1))],
    ids=["knorm", "window"],
)
@torch.no_grad()
def test_answers_on_shared_cache_equal_fresh_cache_answers(compressor):
    model = tiny_model("qwen3")
    context = prompt(30, seed=43)
    shared = kv_hf.compressed_cache(model, compressor, query_window=6)
    kv_hf.prefill(model, shared, context)
    after_prefill, nbytes = _state(shared), shared.nbytes()
    seq = shared.get_seq_length()
    for q in QUESTIONS:
        got = kv_hf.generate_answer(model, shared, q[None], max_new_tokens=7)
        fresh = kv_hf.compressed_cache(model, compressor, query_window=6)
        kv_hf.prefill(model, fresh, context)
        want = kv_hf.generate_answer(model, fresh, q[None], max_new_tokens=7)
        assert got.shape == (1, 7) and torch.equal(got, want)
        # rolled back: same true length, same entries and positions as right after the prefill
        assert shared.get_seq_length() == seq == 30
        for (k, p), (k0, p0) in zip(_state(shared), after_prefill):
            assert torch.equal(k, k0) and torch.equal(p, p0)
    # the answer tokens were really appended while answering (then cropped): storage grew to hold them
    assert shared.nbytes() > nbytes


@torch.no_grad()
def test_answer_continues_at_true_position_and_keep_extends_the_cache():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    kv_hf.prefill(model, cache, prompt(20, seed=44))
    q = QUESTIONS[0][None]
    out = kv_hf.generate_answer(model, cache, q, max_new_tokens=4, keep=True)
    assert cache.get_seq_length() == 20 + 5 + 3
    pos = cache.layers[0].store.read().positions[0, 0]
    assert pos[-8:].tolist() == list(range(20, 28))
    # the same continuation decoded by hand with explicit positions
    ref = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    kv_hf.prefill(model, ref, prompt(20, seed=44))
    logits = model(q, past_key_values=ref, position_ids=torch.arange(20, 25)[None]).logits[:, -1]
    toks = []
    for i in range(4):
        toks.append(logits.argmax(-1))
        logits = model(toks[-1][:, None], past_key_values=ref, position_ids=torch.tensor([[25 + i]])).logits[:, -1]
    assert torch.equal(out, torch.stack(toks, 1))


@torch.no_grad()
def test_eos_stops_generation():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    kv_hf.prefill(model, cache, prompt(16, seed=45))
    free = kv_hf.generate_answer(model, cache, QUESTIONS[1][None], max_new_tokens=6)
    stop = int(free[0, 2])
    first = int((free[0] == stop).nonzero()[0])
    cut = kv_hf.generate_answer(model, cache, QUESTIONS[1][None], max_new_tokens=6, eos_token_id=stop)
    assert torch.equal(cut[0], free[0, : first + 1])


@torch.no_grad()
def test_answer_questions_matches_manual_protocol():
    model = tiny_model("mistral")
    tok = CharTokenizer()
    context = "The pass key is 41729. Remember it. " * 2
    questions = ["What is the pass key?", "Repeat it."]
    compressor = make(KnormScorer(), ratio=0.5)
    answers = kv_hf.answer_questions(model, tok, context, questions, compressor, max_new_tokens=5)
    cache = kv_hf.compressed_cache(model, compressor)
    kv_hf.prefill(model, cache, torch.tensor([tok.encode(context)]))
    for question, answer in zip(questions, answers):
        ids = kv_hf.generate_answer(
            model,
            cache,
            torch.tensor([tok.encode(question, add_special_tokens=False)]),
            5,
            eos_token_id=tok.eos_token_id,
        )
        assert answer == tok.decode(ids[0].tolist())


@torch.no_grad()
def test_generate_after_prefill_continues_the_compressed_context():
    """``model.generate(context + question)`` on a prefilled cache feeds only the question (true length)."""
    model = tiny_model("qwen2")
    context, q = prompt(22, seed=46), QUESTIONS[1][None]
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    kv_hf.prefill(model, cache, context)
    want = kv_hf.generate_answer(model, cache, q, max_new_tokens=5)
    out = model.generate(torch.cat([context, q], 1), max_new_tokens=5, do_sample=False, past_key_values=cache)
    assert torch.equal(out[:, 22 + q.shape[1] :], want)
    assert cache.get_seq_length() == 22 + q.shape[1] + 4
