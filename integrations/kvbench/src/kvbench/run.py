"""Run methods x ratios on generated tasks and continuation KL with a real model, against the full cache."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from kv_hf.cache import compressed_cache
from kv_hf.prefill import prefill
from kv_hf.reuse import generate_answer
from kvbench.memory import peak_memory
from kvbench.report import Row
from kvbench.tasks import TaskSample, score
from kvcore import Budget, Compressor
from kvcore.registry import Method


@dataclass
class Workload:
    """What every (method, ratio) is evaluated on."""

    samples: list[TaskSample]
    kl_pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)


def _full_cache_bytes(model, n_tokens: int) -> int:
    """Bytes of an uncompressed K+V cache of ``n_tokens`` in the model's dtype."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elt = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * n_tokens * elt


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


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    compressor: Compressor,
    work: Workload,
    full_logits: Sequence[torch.Tensor] | None = None,
) -> tuple[Row, list[torch.Tensor]]:
    """Evaluate one compressor; returns its row and its continuation logits (the reference for others when
    ``compressor`` is the full cache)."""
    device = next(model.parameters()).device
    row = Row(method=compressor.name or type(compressor.scorer).__name__, ratio=compressor.budget.ratio or 0.0)
    acc: dict[str, list[float]] = {}
    kv_bytes, kv_frac, prefill_s, compress_s, peaks, rates = [], [], [], [], [], []
    eos = getattr(tokenizer, "eos_token_id", None)
    for s in work.samples:
        ids = torch.tensor([tokenizer.encode(s.context, add_special_tokens=True)], device=device)
        q = torch.tensor([tokenizer.encode(s.question, add_special_tokens=False)], device=device)
        cache, last, t, tc, peak = _prefill(model, tokenizer, compressor, ids)
        kv_bytes.append(cache.nbytes())  # before any decode step (appends reserve growth slack in the Stores)
        kv_frac.append(cache.nbytes() / _full_cache_bytes(model, ids.shape[1]))
        if not rates:  # one measurement per method: 16 steps over the first sample's compressed context
            rates.append(decode_rate(model, cache, last.argmax(-1)))
        prefill_s.append(t)
        compress_s.append(tc)
        peaks.append(peak)
        out = generate_answer(model, cache, q, s.max_new_tokens, eos_token_id=eos)
        text = tokenizer.decode(out[0].tolist(), skip_special_tokens=True)
        acc.setdefault(f"{s.task}@{s.target_length}", []).append(score(text, s))
    logits_out, kls, nlls = [], [], []
    for i, (ctx_ids, cont_ids) in enumerate(work.kl_pairs):
        ids = torch.tensor([ctx_ids], device=device)
        cont = torch.tensor([cont_ids], device=device)
        cache, last, t, tc, peak = _prefill(model, tokenizer, compressor, ids)
        kv_bytes.append(cache.nbytes())
        kv_frac.append(cache.nbytes() / _full_cache_bytes(model, ids.shape[1]))
        prefill_s.append(t)
        compress_s.append(tc)
        peaks.append(peak)
        pos = cache.next_positions().to(device)[:, None] + torch.arange(cont.shape[1] - 1, device=device)
        rest = model(input_ids=cont[:, :-1], past_key_values=cache, position_ids=pos, use_cache=True).logits
        logits = torch.cat([last.reshape(1, 1, -1), rest], 1).float().log_softmax(-1)[0]  # [k, V]
        logits_out.append(logits)
        nlls.append(-logits.gather(-1, cont[0, :, None]).mean())
        if full_logits is not None:
            ref = full_logits[i]
            kls.append((ref.exp() * (ref - logits)).sum(-1).mean())
    row.accuracy = {k: sum(v) / len(v) for k, v in acc.items()}
    row.samples = len(work.samples) + len(work.kl_pairs)
    row.kv_bytes = sum(kv_bytes) / max(1, len(kv_bytes))
    row.kv_fraction = sum(kv_frac) / max(1, len(kv_frac))
    row.prefill_s = sum(prefill_s) / max(1, len(prefill_s))
    row.compress_s = sum(compress_s) / max(1, len(compress_s))
    known = [p for p in peaks if p is not None]
    row.peak_bytes = max(known) if known else None
    row.decode_tok_s = sum(rates) / len(rates) if rates else None
    if nlls:
        row.ppl = math.exp(float(torch.stack(nlls).mean()))
    if kls:
        row.kl = float(torch.stack(kls).mean())
    return row, logits_out


def run_grid(
    model,
    tokenizer,
    methods: dict[str, Method],
    grid: list[tuple[str, Budget]],
    work: Workload,
    progress: bool = True,
) -> list[Row]:
    """Evaluate the full cache first (the reference), then every (method name, budget) of ``grid``.

    Parameters
    ----------
    model, tokenizer
        A causal LM supported by :mod:`kv_hf` and its tokenizer.
    methods : dict of str to kvcore.registry.Method
        The registry (:func:`kvcore.registry.discover`); it must hold ``"full"`` (kv-baselines), the reference.
    grid : list of (str, kvcore.Budget)
        What to evaluate, e.g. from :func:`kvbench.methods.plan_grid`; ``"full"`` entries are the reference row.
    work : Workload
        Task samples and continuation windows.
    progress : bool
        Show a progress bar.
    """
    if "full" not in methods:
        raise ValueError("the registry must provide the 'full' method (kv-baselines) as the reference")
    rows: list[Row] = []
    bar = tqdm(total=len(grid) + 1, desc="kvbench", disable=not progress)
    ref_row, ref_logits = evaluate(model, tokenizer, methods["full"].build(), work)
    ref_row.kl = 0.0 if work.kl_pairs else None
    rows.append(ref_row)
    bar.update()
    for name, budget in grid:
        if name == "full":
            bar.update()
            continue
        ratio = budget.ratio or 0.0
        bar.set_postfix_str(f"{name}@{ratio:g}")
        try:
            row, _ = evaluate(model, tokenizer, methods[name].build(budget), work, ref_logits)
        except (ValueError, LookupError) as exc:  # a configuration refused (budget below the protected window, no base)
            rows.append(Row(method=name, ratio=ratio, error=str(exc)))
            bar.update()
            continue
        row.method, row.ratio = name, ratio
        rows.append(row)
        bar.update()
    bar.close()
    return rows


def describe_machine() -> dict[str, Any]:
    """CPU / GPU description for the results' metadata."""
    import os
    import platform

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
