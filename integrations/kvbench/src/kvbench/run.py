"""Run methods x budgets x protocols on generated tasks and continuation KL with a real model.

Every cell (one method at one budget under one protocol on the task samples, or one method at one budget on the
continuation windows) keeps its per-sample and per-window results, so rows can be paired with a reference
(:mod:`kvbench.paired`). Finished cells are stored in a :class:`~kvbench.cells.CellCache`; a rerun skips them.

Methods share prefills: one exact forward pass per prompt, then one compression per method
(:func:`kv_hf.shared.collect_prefill`); a cell's ``prefill_s`` is that shared forward pass and its ``compress_s``
the method's own compression (and provider passes such as KVzip's reconstruction).

Protocols: ``"agnostic"`` compresses the context before the question is seen (the kvpress / KVzip protocol);
``"aware"`` compresses the context *and* the question (all but its last token, which starts decoding), the
setting of SnapKV, H2O and most LongBench numbers. Continuation windows have no question: their KL is the same
under both protocols and is computed once per (method, budget).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from kv_hf.cache import compressed_cache
from kv_hf.prefill import prefill
from kv_hf.reuse import generate_answer
from kv_hf.shared import collect_prefill
from kvbench.cells import CellCache, code_fingerprint
from kvbench.match import match_budget
from kvbench.memory import peak_memory
from kvbench.methods import GridItem
from kvbench.report import Row
from kvbench.tasks import TaskSample, score
from kvcore import Budget, Compressor
from kvcore.registry import Method


@dataclass
class Workload:
    """What every (method, ratio) is evaluated on."""

    samples: list[TaskSample]
    kl_pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def fingerprint(self) -> str:
        """Hash of the exact prompts, answers and windows (cells of a different workload are never reused)."""
        data = [[s.context, s.question, s.answers, s.task, s.target_length] for s in self.samples]
        digest = hashlib.sha256(json.dumps([data, self.kl_pairs]).encode())
        return digest.hexdigest()[:16]


PROTOCOLS = ("agnostic", "aware")


def fp16_bytes_per_token(model) -> int:
    """Bytes per token of an uncompressed K+V cache in fp16 (all layers and KV heads): the equal-bytes yardstick."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2


@torch.no_grad()
def _prefill(model, tokenizer, compressor: Compressor, ids: torch.Tensor):
    cache = compressed_cache(model, compressor)
    with peak_memory(ids.device) as peak:
        t0 = time.perf_counter()
        logits = prefill(model, cache, ids, tokenizer=tokenizer)
        elapsed = time.perf_counter() - t0
    return cache, logits, elapsed, cache.compress_seconds, peak.bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode_rate(model, cache, first_token: torch.Tensor, steps: int = 16) -> float:
    """Greedy single-token decode steps per second over ``cache`` (what it holds after compression), timing the
    steps only — no question prefill — then rolling the cache back to where it was.

    Parameters
    ----------
    model, cache
        The model and a prefilled :class:`~kv_hf.cache.CompressedCache`.
    first_token : Tensor
        ``[B]`` token to start from (e.g. the argmax of the prefill's last logits).
    steps : int
        Timed decode steps.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    length = cache.get_seq_length()
    device = first_token.device
    pos = cache.next_positions().to(device)[:, None]
    tok = first_token[:, None]
    # held: a sliding-window layer (Gemma 3) keeps what slides out during the steps, so the rollback restores it
    with cache.held():
        try:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
                tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
            _sync(device)
            return steps / (time.perf_counter() - t0)
        finally:
            cache.rollback(length)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@torch.no_grad()
def evaluate_samples(
    model,
    tokenizer,
    compressor: Compressor,
    samples: Sequence[TaskSample],
    protocol: str = "agnostic",
    tick: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Answer every sample through ``compressor``'s cache; per-sample scores, bytes and timings.

    Parameters
    ----------
    model, tokenizer
        A causal LM supported by :mod:`kv_hf` and its tokenizer.
    compressor : kvcore.Compressor
        Built fresh per cell (a cache is built per sample).
    samples : sequence of TaskSample
        Context (compressed), question (appended), answers (scored by :func:`kvbench.tasks.score`).
    protocol : {"agnostic", "aware"}
        Whether the question is compressed with the context (``"aware"``: all of it but its last token).
    tick : callable, optional
        Called after each sample (progress).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    device = next(model.parameters()).device
    eos = getattr(tokenizer, "eos_token_id", None)
    out: dict[str, Any] = {
        k: [] for k in ("scores", "tasks", "kv_bytes", "resident_bytes", "tokens", "prefill_s", "compress_s", "peak")
    }
    out["decode_tok_s"] = None
    for s in samples:
        ctx = tokenizer.encode(s.context, add_special_tokens=True)
        q = tokenizer.encode(s.question, add_special_tokens=False)
        if not q:
            raise ValueError(f"sample of task {s.task!r} has an empty question")
        prompt, ask = (ctx + q[:-1], q[-1:]) if protocol == "aware" else (ctx, q)
        ids = torch.tensor([prompt], device=device)
        cache, last, t, tc, peak = _prefill(model, tokenizer, compressor, ids)
        out["kv_bytes"].append(cache.nbytes())  # before any decode step (appends reserve growth slack)
        out["resident_bytes"].append(cache.resident_nbytes())
        out["tokens"].append(len(prompt))
        if out["decode_tok_s"] is None:  # one measurement per cell: 16 steps over the first compressed context
            out["decode_tok_s"] = decode_rate(model, cache, last.argmax(-1))
        out["prefill_s"].append(t)
        out["compress_s"].append(tc)
        out["peak"].append(peak)
        answer = generate_answer(model, cache, torch.tensor([ask], device=device), s.max_new_tokens, eos_token_id=eos)
        text = tokenizer.decode(answer[0].tolist(), skip_special_tokens=True)
        out["scores"].append(score(text, s))
        out["tasks"].append(f"{s.task}@{s.target_length}")
        if tick is not None:
            tick()
    return out


@torch.no_grad()
def evaluate_windows(
    model,
    tokenizer,
    compressor: Compressor,
    pairs: Sequence[tuple[list[int], list[int]]],
    reference: Sequence[torch.Tensor] | None = None,
    tick: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Teacher-forced continuations after compressed contexts: per-window KL(reference || compressed) and NLL.

    Returns the per-window results and the continuation log-probabilities (the reference for the other cells
    when ``compressor`` is the full cache).
    """
    device = next(model.parameters()).device
    out: dict[str, Any] = {
        k: [] for k in ("kl", "nll", "kv_bytes", "resident_bytes", "tokens", "prefill_s", "compress_s", "peak")
    }
    logprobs = []
    for i, (ctx_ids, cont_ids) in enumerate(pairs):
        ids = torch.tensor([ctx_ids], device=device)
        cont = torch.tensor([cont_ids], device=device)
        cache, last, t, tc, peak = _prefill(model, tokenizer, compressor, ids)
        out["kv_bytes"].append(cache.nbytes())
        out["resident_bytes"].append(cache.resident_nbytes())
        out["tokens"].append(len(ctx_ids))
        out["prefill_s"].append(t)
        out["compress_s"].append(tc)
        out["peak"].append(peak)
        lp = _continuation(model, cache, last, cont)  # [k, V]
        logprobs.append(lp)
        out["nll"].append(float(-lp.gather(-1, cont[0, :, None]).mean()))
        if reference is not None:
            ref = reference[i]
            out["kl"].append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
        if tick is not None:
            tick()
    if reference is None:
        out["kl"] = None
    return out, logprobs


def _row(item: GridItem, protocol: str, tasks: dict | None, windows: dict | None, fp16_bpt: int) -> Row:
    row = Row(method=item.name, budget=item.label, protocol=protocol)
    kv, resident, toks, pre, comp, peaks = [], [], [], [], [], []
    for part in (tasks, windows):
        if part:
            kv += part["kv_bytes"]
            # a cell computed by a kvbench that did not record resident bytes (or resumed from such progress) lacks
            # the first ones: they are counted as all resident (true of every store that offloads nothing)
            res = part.get("resident_bytes", [])
            resident += part["kv_bytes"][: len(part["kv_bytes"]) - len(res)] + list(res)
            toks += part["tokens"]
            pre += part["prefill_s"]
            comp += part["compress_s"]
            peaks += [p for p in part["peak"] if p is not None]
    if tasks:
        row.scores = list(tasks["scores"])
        by_task: dict[str, list[float]] = {}
        for name, sc in zip(tasks["tasks"], tasks["scores"]):
            by_task.setdefault(name, []).append(sc)
        row.accuracy = {k: _mean(v) for k, v in by_task.items()}
        row.decode_tok_s = tasks["decode_tok_s"]
    if windows:
        if row.decode_tok_s is None:  # a run without task samples: the rate measured on the first window
            row.decode_tok_s = windows.get("decode_tok_s")
        row.window_kl = windows["kl"]
        row.kl = _mean(windows["kl"]) if windows["kl"] is not None else None
        row.ppl = math.exp(_mean(windows["nll"])) if windows["nll"] else None
    row.samples = len(row.scores) + (len(windows["nll"]) if windows else 0)
    row.kv_bytes = _mean(kv)
    row.bytes_per_token = _mean([b / t for b, t in zip(kv, toks)])
    row.resident_bytes_per_token = _mean([b / t for b, t in zip(resident, toks)])
    row.fp16_fraction = row.bytes_per_token / fp16_bpt
    row.prefill_s, row.compress_s = _mean(pre), _mean(comp)
    row.peak_bytes = max(peaks) if peaks else None
    return row


EVALUATION_CODE: tuple[str, ...] = (
    "kvcore",
    "kvcodec",
    "kv_hf",
    "kvbench.run",
    "kvbench.memory",
    "kvbench.match",
    "kvbench.tasks",
    "kvbench.models",
)
"""Modules whose code decides every cell's result besides the method's own package (the presentation modules --
CLI, statistics, reports -- work from the cells' per-unit results and are left out)."""


def _packages(obj: Any, found: set[str], seen: set[int], depth: int = 4) -> None:
    """Top-level packages of the classes and functions reachable from ``obj`` (attributes, containers, closures)."""
    if depth < 0 or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.Tensor)):
        return
    seen.add(id(obj))
    module = getattr(obj, "__module__", None) if callable(obj) else type(obj).__module__
    if isinstance(module, str) and module not in ("builtins", "functools"):
        found.add(module.split(".")[0])
    children: list[Any] = []
    if isinstance(obj, dict):
        children += list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children += list(obj)
    if callable(obj) and getattr(obj, "__closure__", None):
        children += [cell.cell_contents for cell in obj.__closure__ if cell.cell_contents is not None]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        children += list(vars(obj).values())
    for child in children:
        _packages(child, found, seen, depth - 1)


def method_code(method: Method) -> str:
    """:func:`kvbench.cells.code_fingerprint` of what computes ``method``'s cells: the top-level packages of the
    objects its compressor is built from at its default budget (``kv_hubkv`` and ``kv_baselines`` for
    ``hubkv-snapkv``, whose base comes from the registry) -- the scorer, selector, store factory and what they
    hold or close over -- the package of its factory, and :data:`EVALUATION_CODE`."""
    found: set[str] = set()
    _packages(method.factory, found, set())
    with contextlib.suppress(TypeError, ValueError):  # a factory refusing its default budget: its own package only
        _packages(method.build(), found, set())
    found -= {"torch", "typing", "collections", "dataclasses", "abc", "__main__"}
    return code_fingerprint([*EVALUATION_CODE, *sorted(found)])


def code_changed(methods: dict[str, Method], before: dict[str, str]) -> list[str]:
    """The methods of ``before`` (name -> :func:`method_code` taken when a run started) whose code differs now,
    read from the files again: an edit made while a run was going, which the cells' keys (taken at the start) do
    not show."""
    from kvbench.cells import _source_digest

    _source_digest.cache_clear()
    return [name for name, code in sorted(before.items()) if method_code(methods[name]) != code]


def run_grid(
    model,
    tokenizer,
    methods: dict[str, Method],
    grid: list[GridItem],
    work: Workload,
    *,
    protocols: Sequence[str] = ("agnostic",),
    cache: CellCache | None = None,
    progress: bool = True,
) -> list[Row]:
    """Evaluate the full cache (the reference) and every grid item under every protocol; rows in grid order.

    Each sample's prompt and each window's context is prefilled **once** and compressed by every method that
    still needs it (:func:`kv_hf.shared.collect_prefill`: the compressed caches are exactly those a prefill per
    method gives), so a grid costs one forward pass per prompt instead of one per cell. Progress is checkpointed
    after every sample and window (partial cells), so an interrupted run resumes mid-cell.

    Parameters
    ----------
    model, tokenizer
        A causal LM supported by :mod:`kv_hf` and its tokenizer.
    methods : dict of str to kvcore.registry.Method
        The registry (:func:`kvcore.registry.discover`); it must hold ``"full"`` (kv-baselines), the reference.
    grid : list of GridItem
        From :func:`kvbench.methods.plan_grid`; bytes-per-token targets are matched here (:mod:`kvbench.match`)
        on the first continuation window (else the first sample).
    work : Workload
        Task samples and continuation windows.
    protocols : sequence of {"agnostic", "aware"}
        Protocols of the task cells (the full cache compresses nothing, so its task cell is shared by both).
    cache : CellCache, optional
        Finished cells to reuse and where new ones are stored.
    progress : bool
        A tqdm bar over samples and windows of the cells still to run, with an ETA.
    """
    if "full" not in methods:
        raise ValueError("the registry must provide the 'full' method (kv-baselines) as the reference")
    for p in protocols:
        if p not in PROTOCOLS:
            raise ValueError(f"protocols must be among {PROTOCOLS}, got {p!r}")
    cache = cache if cache is not None else _MemoryCache()
    fp16_bpt = fp16_bytes_per_token(model)
    full = GridItem("full", methods["full"].default)
    items = [full] + [g for g in grid if g.name != "full"]
    calibration = _Calibration(model, tokenizer, work)
    items = _distinct([_resolve(methods, g, calibration, cache) for g in items])

    cells = Cells({i.name: method_code(methods[i.name]) for i in items}, tuple(protocols))  # builds each once
    task_cell, kl_cell, protocols_of = cells.task, cells.kl, cells.protocols_of
    todo = sum(cells.left(item, work, cache) for item in items if item.budget is not None)
    bar = tqdm(total=todo, desc="kvbench", unit="unit", disable=not progress)
    runnable = [i for i in items if i.budget is not None]
    if work.kl_pairs:
        members = [_Member(i, kl_cell(i), methods[i.name]) for i in runnable]
        _windows_shared(model, tokenizer, members, work.kl_pairs, cache, bar, methods["full"])
    if work.samples:
        for p in PROTOCOLS:  # the full cache's task cell ("any") is computed once, without the question
            group = [i for i in runnable if (p == "agnostic" if i.name == "full" else p in protocols)]
            members = [_Member(i, task_cell(i, "any" if i.name == "full" else p), methods[i.name]) for i in group]
            _samples_shared(model, tokenizer, members, work.samples, p, cache, bar)
    bar.close()

    rows: list[Row] = []
    for item in items:
        if item.budget is None:  # a bytes target no budget of the method could meet
            rows += [Row(method=item.name, budget=item.label, protocol=p, error=item.target_error) for p in protocols]
            continue
        windows = cache.get(kl_cell(item)) if work.kl_pairs else None
        per_protocol = {p: cache.get(task_cell(item, p)) for p in protocols_of(item)} if work.samples else {}
        errors = [r["error"] for r in [windows, *per_protocol.values()] if r is not None and "error" in r]
        if errors:
            rows += [Row(method=item.name, budget=item.label, protocol=p, error=errors[0]) for p in protocols]
            continue
        for p in protocols:
            row = _row(item, p, per_protocol.get("any", per_protocol.get(p)), windows, fp16_bpt)
            if item.target is not None:
                row.matched = {"target_bytes_per_token": item.target.value, "calibration": item.calibration}
            rows.append(row)
    return rows


@dataclass(frozen=True)
class Cells:
    """The keys of a run's cells in a :class:`~kvbench.cells.CellCache`: what :func:`run_grid` stores and finds.

    Parameters
    ----------
    codes : dict of str to str
        :func:`method_code` of every method of the run.
    protocols : tuple of str
        The run's protocols (the full cache's task cell is protocol-free: ``"any"``).
    """

    codes: dict[str, str]
    protocols: tuple[str, ...] = ("agnostic",)

    def task(self, item: GridItem, protocol: str) -> dict:
        code = self.codes[item.name]
        return {"kind": "tasks", "method": item.name, "budget": item.label, "protocol": protocol, "code": code}

    def kl(self, item: GridItem) -> dict:
        return {"kind": "kl", "method": item.name, "budget": item.label, "code": self.codes[item.name]}

    def match(self, item: GridItem) -> dict:
        """The cell of a bytes-per-token target's budget search (:func:`kvbench.match.match_budget`)."""
        return {"kind": "match", "method": item.name, "target": item.target.value, "code": self.codes[item.name]}

    def protocols_of(self, item: GridItem) -> list[str]:
        return ["any"] if item.name == "full" else list(self.protocols)

    def left(self, item: GridItem, work: Workload, cache) -> int:
        """Units (task samples per protocol, continuation windows) of ``item`` not computed yet in ``cache``; a
        bytes target counts as resolved when its budget search is stored (all of its units otherwise), and a target
        no budget meets as done."""
        if item.budget is None:
            found = cache.get(self.match(item))
            if found is not None and "error" in found:
                return 0
            if found is not None:
                item = GridItem(item.name, Budget(**found["budget"]), item.target)
        todo = 0
        if work.samples:
            n = len(work.samples)
            todo += sum(
                n - (0 if item.budget is None else _done(cache, self.task(item, p), n)) for p in self.protocols_of(item)
            )
        if work.kl_pairs:
            n = len(work.kl_pairs)
            todo += n - (0 if item.budget is None else _done(cache, self.kl(item), n))
        return todo


@dataclass
class _Member:
    """One cell of a group that shares its prefills: what it has so far, or why its method refused."""

    item: GridItem
    cell: dict
    method: Method
    result: dict | None = None
    compressor: Compressor | None = None
    error: str | None = None
    finished: bool = False

    @property
    def done(self) -> int:
        return len((self.result or {}).get("tokens", []))


def _partial(cell: dict) -> dict:
    return {**cell, "partial": True}


def _done(cache, cell: dict, total: int) -> int:
    """Units of ``cell`` (of ``total``) already computed: all when finished or refused, else the partial count."""
    if cache.get(cell) is not None:
        return total
    part = cache.get(_partial(cell))
    return min(total, len(part.get("tokens", []))) if part else 0


def _open(members: list[_Member], cache, fresh: Callable[[], dict]) -> list[_Member]:
    """Load finished cells and partial progress; build each method's compressor (a refusal finishes its cell)."""
    todo = []
    for m in members:
        found = cache.get(m.cell)
        if found is not None:
            continue
        m.result = cache.get(_partial(m.cell)) or fresh()
        for key, empty in fresh().items():  # progress saved by an older kvbench may lack a newer key
            m.result.setdefault(key, empty)
        m.result.setdefault("elapsed_s", 0.0)
        try:
            m.compressor = m.method.build(m.item.budget)
        except (ValueError, LookupError) as exc:  # refused: budget below the protected window ...
            cache.put(m.cell, {"error": str(exc)})
            continue
        todo.append(m)
    return todo


def _refuse(m: _Member, exc: Exception, cache) -> None:
    m.error = str(exc)
    cache.put(m.cell, {"error": m.error})


def _checkpoint(members: list[_Member], total: int, cache) -> None:
    """After each sample or window: finished cells are stored, unfinished ones as partial progress."""
    for m in members:
        if m.error is not None or m.finished:
            continue
        if m.done >= total:
            m.finished = True
            cache.put(m.cell, m.result)
            cache.discard(_partial(m.cell))  # the finished cell replaces its progress
        else:
            cache.put(_partial(m.cell), m.result)


@torch.no_grad()
def _samples_shared(model, tokenizer, members: list[_Member], samples, protocol: str, cache, bar) -> None:
    """Task cells of one protocol: each sample's prompt is prefilled once (:func:`kv_hf.shared.collect_prefill`)
    and compressed by every method, which is exactly what a prefill per method gives (tested in kv-hf)."""
    keys = ("scores", "tasks", "kv_bytes", "resident_bytes", "tokens", "prefill_s", "compress_s", "peak")
    members = _open(members, cache, lambda: {**{k: [] for k in keys}, "decode_tok_s": None})
    device = next(model.parameters()).device
    eos = getattr(tokenizer, "eos_token_id", None)
    for idx, s in enumerate(samples):
        active = [m for m in members if m.error is None and m.done == idx]
        if not active:
            continue
        ctx = tokenizer.encode(s.context, add_special_tokens=True)
        q = tokenizer.encode(s.question, add_special_tokens=False)
        if not q:
            raise ValueError(f"sample of task {s.task!r} has an empty question")
        prompt, ask = (ctx + q[:-1], q[-1:]) if protocol == "aware" else (ctx, q)
        ids = torch.tensor([prompt], device=device)
        with peak_memory(device) as fwd_peak:
            collected = collect_prefill(model, ids, tokenizer=tokenizer)
        share = collected.forward_seconds / len(active)
        for m in active:
            bar.set_postfix_str(f"{m.item.name} {m.item.label} {protocol}", refresh=False)
            t0 = time.perf_counter()
            cache_ = _compress(m, collected, fwd_peak.bytes, cache)
            if cache_ is None:
                continue
            r = m.result
            if r["decode_tok_s"] is None:  # one measurement per cell: 16 steps over the first compressed context
                r["decode_tok_s"] = decode_rate(model, cache_, collected.logits.argmax(-1))
            answer = generate_answer(
                model, cache_, torch.tensor([ask], device=device), s.max_new_tokens, eos_token_id=eos
            )
            text = tokenizer.decode(answer[0].tolist(), skip_special_tokens=True)
            r["scores"].append(score(text, s))
            r["tasks"].append(f"{s.task}@{s.target_length}")
            r["elapsed_s"] += time.perf_counter() - t0 + share
            bar.update()
        del collected
        _checkpoint(members, len(samples), cache)


@torch.no_grad()
def _windows_shared(model, tokenizer, members: list[_Member], pairs, cache, bar, reference: Method) -> None:
    """KL cells: each window's context is prefilled once and compressed by the full cache (the reference
    continuation) and by every method; per-window KL(full || method) and NLL."""
    keys = ("kl", "nll", "kv_bytes", "resident_bytes", "tokens", "prefill_s", "compress_s", "peak")
    members = _open(members, cache, lambda: {**{k: [] for k in keys}, "decode_tok_s": None})
    if not members:
        return
    device = next(model.parameters()).device
    for idx, (ctx_ids, cont_ids) in enumerate(pairs):
        active = [m for m in members if m.error is None and m.done == idx]
        if not active:
            continue
        ids = torch.tensor([ctx_ids], device=device)
        cont = torch.tensor([cont_ids], device=device)
        with peak_memory(device) as fwd_peak:
            collected = collect_prefill(model, ids, tokenizer=tokenizer)
        share = collected.forward_seconds / len(active)
        ref_cache = collected.compress(reference.build())  # the reference continuation, recomputed per window
        ref = _continuation(model, ref_cache, collected.logits, cont)
        del ref_cache
        for m in active:
            bar.set_postfix_str(f"{m.item.name} {m.item.label} KL", refresh=False)
            t0 = time.perf_counter()
            cache_ = _compress(m, collected, fwd_peak.bytes, cache)
            if cache_ is None:
                continue
            r = m.result
            lp = ref if m.item.name == "full" else _continuation(model, cache_, collected.logits, cont)
            r["nll"].append(float(-lp.gather(-1, cont[0, :, None]).mean()))
            r["kl"].append(0.0 if m.item.name == "full" else float((ref.exp() * (ref - lp)).sum(-1).mean()))
            if r["decode_tok_s"] is None:  # one measurement per cell, after the continuation (which it leaves as is)
                r["decode_tok_s"] = decode_rate(model, cache_, collected.logits.argmax(-1))
            r["elapsed_s"] += time.perf_counter() - t0 + share
            bar.update()
        del collected
        _checkpoint(members, len(pairs), cache)


def _compress(m: _Member, collected, forward_peak: int | None, cache):
    """Compress the shared prefill for ``m`` and record held bytes (before any decode step: appends reserve growth
    slack), tokens, the shared forward time, its own compression time and peak memory; ``None`` (and the cell
    refused) when the method refuses this input."""
    device = collected.input_ids.device
    try:
        with peak_memory(device) as peak:
            cache_ = collected.compress(m.compressor)
    except (ValueError, LookupError) as exc:
        _refuse(m, exc, cache)
        return None
    r = m.result
    r["kv_bytes"].append(cache_.nbytes())
    r["resident_bytes"].append(cache_.resident_nbytes())
    r["tokens"].append(collected.input_ids.shape[1])
    r["prefill_s"].append(collected.forward_seconds)
    r["compress_s"].append(cache_.compress_seconds)
    r["peak"].append(_max_peak(forward_peak, peak.bytes))
    return cache_


def _continuation(model, cache, last: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probabilities ``[k, V]`` of the continuation ``cont [1, k]`` after ``cache``."""
    device = cont.device
    pos = cache.next_positions().to(device)[:, None] + torch.arange(cont.shape[1] - 1, device=device)
    rest = model(input_ids=cont[:, :-1], past_key_values=cache, position_ids=pos, use_cache=True).logits
    return torch.cat([last.reshape(1, 1, -1), rest], 1).float().log_softmax(-1)[0]


def _max_peak(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else max(a or 0, b or 0)


class _MemoryCache(CellCache):
    """A cell cache that forgets everything when the run ends."""

    def __init__(self) -> None:
        self._cells: dict[str, dict] = {}

    def get(self, cell):
        return self._cells.get(json.dumps(cell, sort_keys=True))

    def put(self, cell, result):
        self._cells[json.dumps(cell, sort_keys=True)] = result

    def discard(self, cell):
        self._cells.pop(json.dumps(cell, sort_keys=True), None)


@dataclass(frozen=True)
class _Resolved(GridItem):
    target_error: str | None = None
    calibration: float | None = None


class _Calibration:
    """The prompt bytes-per-token targets are matched on (the first continuation window, else the first sample's
    context), prefilled once when first needed and compressed once per candidate budget
    (:func:`kv_hf.shared.collect_prefill`: the same caches a prefill per budget gives)."""

    def __init__(self, model, tokenizer, work: Workload) -> None:
        self.model, self.tokenizer, self.work = model, tokenizer, work
        self._collected = None

    def collected(self):
        if self._collected is None:
            device = next(self.model.parameters()).device
            if self.work.kl_pairs:
                calib = self.work.kl_pairs[0][0]
            elif self.work.samples:
                calib = self.tokenizer.encode(self.work.samples[0].context, add_special_tokens=True)
            else:
                raise ValueError("a bytes-per-token budget needs a sample or a continuation window to calibrate on")
            ids = torch.tensor([calib], device=device)
            self._collected = collect_prefill(self.model, ids, tokenizer=self.tokenizer)
        return self._collected


def _resolve(methods: dict[str, Method], item: GridItem, calibration: _Calibration, cache) -> GridItem:
    """Turn a bytes-per-token target into the method's closest budget (measured on one calibration prompt)."""
    if item.budget is not None:
        return item
    target = item.target.value
    cell = Cells({item.name: method_code(methods[item.name])}).match(item)
    found = cache.get(cell)
    if found is None:
        collected = calibration.collected()
        tokens = collected.input_ids.shape[1]
        method = methods[item.name]

        def measure(budget: Budget) -> float:
            return collected.compress(method.build(budget)).resident_nbytes() / tokens

        try:
            m = match_budget(method, target, measure, context_tokens=tokens)
            found = {"budget": _budget_dict(m.budget), "bytes_per_token": m.bytes_per_token}
        except ValueError as exc:
            found = {"error": str(exc)}
        cache.put(cell, found)
    if "error" in found:
        return _Resolved(item.name, None, item.target, target_error=found["error"])
    return _Resolved(item.name, Budget(**found["budget"]), item.target, calibration=found["bytes_per_token"])


def _distinct(items: list[GridItem]) -> list[GridItem]:
    """One item per (method, budget): a bytes target that resolves to a budget already in the grid is that item
    (it keeps the target, so ``--compare`` finds it by either name) rather than a second, identical row."""
    out: list[GridItem] = []
    where: dict[tuple[str, str], int] = {}
    for item in items:
        key = (item.name, item.label) if item.budget is not None else None
        if key is None or key not in where:
            if key is not None:
                where[key] = len(out)
            out.append(item)
        elif item.target is not None and out[where[key]].target is None:
            out[where[key]] = item
    return out


def _budget_dict(b: Budget) -> dict[str, Any]:
    return {k: v for k, v in (("ratio", b.ratio), ("tokens", b.tokens), ("avg_bits", b.avg_bits)) if v is not None}


def describe_machine(device: str = "cpu") -> dict[str, Any]:
    """CPU / GPU description for the results' metadata: platform, CPU model, threads, load, the device's name."""
    import os
    import platform

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        info["cpu"] = platform.processor() or None
    if hasattr(os, "getloadavg"):
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(dev)
    else:
        info["device_name"] = f"CPU ({info.get('cpu') or platform.machine()}, {info['threads']} threads)"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
