"""``kvbench tune``: the best registered method and budget for a memory target, on the user's model and text.

Every option, the model's config (or GGUF header), the text file's length and the reachability of the target are
checked before any weights load: a bad one is a one-line error naming the option (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvbench.models.registry import DEFAULT_MODEL, MODELS
from kvbench.options import (
    UsageError,
    _count,
    _Counting,
    _positive,
    add_run_options,
    check_device,
    device_and_dtype,
    portable_argv,
    versions,
)

DEFAULT_LADDER = (0.1, 0.2, 0.35, 0.5)
"""Byte levels (fractions of an fp16 cache) ``--max-kl`` searches unless ``--levels`` names others."""

DESCRIPTION = """\
Find the registered method and budget that keeps a compressed KV cache closest to the full one at a memory target,
on your model and your text. Every candidate method (--methods, default: every registered one except the papers'
ablations and controls) is matched to the target's bytes (bytes it really holds, measured) and evaluated on
windows cut from --text: teacher-forced continuation KL against the full cache, paired per window (and task accuracy
on the built-in tasks with --tasks). The frontier table (95% CIs, ties with the winner marked), a plot, and the
winner as a line of Python and a registry spec are printed and written to --out.

Goal (one of): --target F, a fraction of the full cache's bytes in fp16 (what a bf16 / fp16 model holds; a float32
run's cache holds twice that: --dtype bfloat16 tunes for a bf16 deployment); --target-bytes N, bytes held per
context token; --max-kl X, the smallest cache whose KL upper 95% bound stays within X nats.

The search is estimated (timings measured on the first window) before it starts; --budget-minutes drops the most
expensive cells until it fits. Finished cells are kept in --out/cells: an interrupted run continues where it stopped.
"""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of the full cache like 0.25, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a target is a fraction of the full cache's bytes in (0, 1); 1 is the full cache itself"
        )
    return value


def _fractions(text: str) -> list[float]:
    return [_fraction(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvbench tune", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a registered model ({', '.join(MODELS)}), a local transformers folder or a .gguf file, loaded offline "
        "(default: %(default)s)",
    )
    ap.add_argument("--text", type=Path, required=True, metavar="FILE", help="UTF-8 text the windows are cut from")
    goal = ap.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target", type=_fraction, metavar="F", help="fraction of the full fp16 cache's bytes")
    goal.add_argument("--target-bytes", type=_positive, metavar="N", help="KV bytes held per context token")
    goal.add_argument("--max-kl", type=_positive, metavar="X", help="KL bound (nats): find the smallest cache")
    ap.add_argument(
        "--levels",
        type=_fractions,
        default=None,
        metavar="F,...",
        help="byte levels (fractions of fp16) evaluated besides the target, for the frontier; with --max-kl the "
        f"levels searched (default: none; --max-kl {','.join(map(str, DEFAULT_LADDER))})",
    )
    ap.add_argument("--methods", default=None, help="comma-separated registered names (default: all but ablations)")
    ap.add_argument("--windows", type=_count(1), default=8, help="windows cut from --text (default: %(default)s)")
    ap.add_argument("--context", type=_count(2), default=512, help="context tokens per window (default: %(default)s)")
    ap.add_argument(
        "--continuation", type=_count(2), default=32, help="continuation tokens per window (default: %(default)s)"
    )
    ap.add_argument("--tasks", default=None, help="built-in tasks to score too (kvbench --list-tasks; default: none)")
    ap.add_argument("--samples", type=_count(1), default=2, help="samples per task (default: %(default)s)")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="relative slack on the target bytes; --max-kl: bytes within which rows tie (default: %(default)s)",
    )
    ap.add_argument("--budget-minutes", type=_positive, default=None, metavar="M", help="trim the grid to fit M min")
    add_run_options(ap, Path("results/tune"))
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``kvbench tune`` options (nothing is read or loaded)."""
    return build_parser().parse_args(argv)


def validate(args: argparse.Namespace, registry: dict, *, files: bool = True):
    """Every check that needs no weights; returns ``(methods, tasks, source, text)``.

    Parameters
    ----------
    args : argparse.Namespace
        From :func:`parse_args`.
    registry : dict
        :func:`kvcore.registry.discover`.
    files : bool
        Also read ``--model`` (config or GGUF header) and ``--text`` (length); ``False`` checks the options alone.

    Raises
    ------
    UsageError
        One line naming the option: an unknown method or task, a target no candidate can reach, a text too short for
        the windows, a model the transformers adapter refuses.
    """
    from kvbench.tune.grid import candidates, floor_fraction
    from kvbench.tune.source import resolve_model

    try:
        names = candidates(registry, args.methods)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if tasks:
        from kvbench.tasks import TASKS

        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise UsageError(f"--tasks: unknown task(s) {unknown}; valid: {', '.join(sorted(TASKS))}")
    check_device(args.device)
    if not 0.0 <= args.tolerance < 1.0:
        raise UsageError(f"--tolerance: {args.tolerance:g} must be in [0, 1)")
    entry = 2.0 if device_and_dtype(args)[1] in ("bfloat16", "float16") else 4.0
    floors = {n: floor_fraction(registry[n], args.context, entry) for n in names}
    if args.target is not None:
        check_reachable(args.target, floors, args.context, "--target")
    if not files:
        return names, tasks, None, None
    try:
        source = resolve_model(args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.target_bytes is not None and source.fp16_bytes_per_token:
        check_bytes(args.target_bytes, source.fp16_bytes_per_token, floors, args.context)
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--text {args.text}: cannot be read as UTF-8 text ({exc})") from None
    need = args.windows * (args.context + args.continuation)
    if len(text.encode()) < need:  # no token is shorter than one byte of its text
        raise UsageError(
            f"--text {args.text}: {len(text.encode())} bytes of text cannot hold {args.windows} windows of "
            f"{args.context} + {args.continuation} tokens ({need} tokens); give a longer text or fewer or shorter "
            "windows (--windows, --context, --continuation)"
        )
    return names, tasks, source, text


def check_reachable(fraction: float, floors: dict[str, float], context: int, option: str) -> None:
    """:class:`UsageError` when ``fraction`` of the full cache is below what every candidate can hold
    (:func:`kvbench.tune.grid.floor_fraction` on ``context``-token windows)."""
    least = min(floors, key=floors.get)
    if fraction < floors[least]:
        raise UsageError(
            f"{option}: {fraction:.3g} of the full cache is below what any candidate can hold on {context}-token "
            f"windows (the least is above {floors[least]:.3g}, {least}); raise the target or lengthen --context"
        )


def check_bytes(target_bytes: float, fp16_bpt: float, floors: dict[str, float], context: int) -> None:
    """``--target-bytes`` against the model's fp16 cache: below it, and reachable (:func:`check_reachable`)."""
    if target_bytes >= fp16_bpt:
        raise UsageError(
            f"--target-bytes: {target_bytes:g} B/token is not below the full fp16 cache of this model "
            f"({fp16_bpt:.0f} B/token): nothing to compress"
        )
    check_reachable(target_bytes / fp16_bpt, floors, context, "--target-bytes")


def main(argv: list[str] | None = None) -> int:
    """Run ``kvbench tune`` (``argv`` without the ``tune`` word); 0 with a recommendation, 1 without one, 2 on a
    bad option."""
    args = parse_args(argv)
    from kvcore.registry import discover

    registry = discover()
    try:
        names, tasks, source, text = validate(args, registry)
    except UsageError as exc:
        print(f"kvbench tune: error: {exc}", file=sys.stderr)
        return 2
    return _run(args, argv, registry, names, tasks, source, text)


def _fail(exc: Exception | str) -> int:
    print(f"kvbench tune: error: {exc}", file=sys.stderr)
    return 2


def _span(seconds) -> str:
    done = [x for x in seconds if x is not None]
    return f"{min(done):.2f}-{max(done):.2f} s" if done else "refused"


def _left(registry, items, work, cache) -> dict[int, tuple[float, bool]]:
    """:data:`kvbench.tune.grid.Left` of ``items``: the share of each one's units not in ``cache`` yet, and whether its
    budget search is still to do."""
    from kvbench.run import Cells, method_code

    cells = Cells({n: method_code(registry[n]) for n in {i.name for i in items}})
    total = len(work.kl_pairs) + len(work.samples)
    out = {}
    for item in items:
        searched = item.budget is not None or cache.get(cells.match(item)) is not None
        out[id(item)] = (cells.left(item, work, cache) / total if total else 0.0, not searched)
    return out


def _run(args, argv, registry, names, tasks, source, text) -> int:
    import torch

    from kvbench.cells import CellCache
    from kvbench.paired import pair_rows
    from kvbench.report import write_json
    from kvbench.run import Workload, describe_machine, fp16_bytes_per_token, run_grid
    from kvbench.tasks import continuation_split, make_tasks
    from kvbench.tune import frontier, grid, report

    device, dtype = device_and_dtype(args)
    machine = describe_machine(device)
    t0 = time.perf_counter()
    model, tok = source.load(dtype=getattr(torch, dtype), device=device)
    load_s = time.perf_counter() - t0
    try:
        windows = list(continuation_split(text, tok, args.context, args.continuation, args.windows, seed=args.seed))
    except ValueError as exc:
        return _fail(f"--text {args.text}: {exc}; give a longer text or fewer or shorter windows")
    fp16 = fp16_bytes_per_token(model)
    floors = {n: grid.floor_fraction(registry[n], args.context, torch.finfo(model.dtype).bits / 8) for n in names}
    if args.target_bytes is not None:
        try:
            check_bytes(args.target_bytes, fp16, floors, args.context)
        except UsageError as exc:
            return _fail(exc)
    target_bpt = args.target * fp16 if args.target is not None else args.target_bytes
    from kv_hf.support import text_config

    held = grid.window_fraction(text_config(model), args.context, torch.finfo(model.dtype).bits / 8)
    if target_bpt is not None and target_bpt < held * fp16 * (1.0 + args.tolerance):
        return _fail(
            f"--target: {target_bpt / fp16:.3g} of the fp16 cache is below what this model's sliding-window layers "
            f"alone hold on {args.context}-token windows in {dtype} ({held:.3g}: kv_hf keeps their window whatever "
            "the method); raise the target, lengthen --context, or use --dtype bfloat16"
        )
    levels = list(args.levels or ([] if args.max_kl is None else DEFAULT_LADDER))
    level_bpt = ([target_bpt] if target_bpt is not None else []) + [f * fp16 for f in levels]
    items = grid.grid(registry, names, list(dict.fromkeys(level_bpt)))
    samples = make_tasks(tasks, [args.context], [0.5], args.samples, tok, seed=args.seed) if tasks else []
    work = Workload(samples, windows)

    context = {"model": source.fingerprint, "dtype": dtype, "device": device, "work": work.fingerprint()}
    if args.fresh:
        context["fresh"] = time.time()
    counter = _Counting(CellCache(args.out / "cells", context))
    left = _left(registry, items, work, counter.inner)
    costs = grid.measure_costs(model, tok, registry, names, windows[0], progress=not args.no_progress)
    n_w, n_s = len(windows), len(samples)
    full_s = grid.estimate(items, costs, n_w, n_s, left)
    print(
        f"kvbench tune: {len(items)} cells ({len(names)} methods at {len(level_bpt)} byte level(s)), estimated "
        f"{full_s / 60:.1f} min (what {args.out}/cells already holds is not counted; measured on one window: forward "
        f"{costs.forward_s:.2f} s, continuation {costs.continuation_s:.2f} s, decode step {costs.step_s:.3f} s, "
        f"compression {_span(costs.compress_s.values())})",
        file=sys.stderr,
    )
    dropped: list = []
    if args.budget_minutes is not None and full_s > 60 * args.budget_minutes:
        items, dropped = grid.trim(items, costs, n_w, n_s, 60 * args.budget_minutes, left)
        if not items:
            return _fail(
                f"--budget-minutes {args.budget_minutes:g}: even the cheapest cell does not fit (the search would "
                f"take about {full_s / 60:.1f} min); raise it, or use fewer or shorter windows or fewer --methods"
            )
        print(
            f"kvbench tune: that is longer than --budget-minutes {args.budget_minutes:g}; dropping "
            f"{len(dropped)} cell(s) ({', '.join(f'{d.name} {d.label}' for d in dropped)}) to fit about "
            f"{grid.estimate(items, costs, n_w, n_s, left) / 60:.1f} min",
            file=sys.stderr,
        )
    estimate_s = grid.estimate(items, costs, n_w, n_s, left)

    rows = run_grid(model, tok, registry, items, work, cache=counter, progress=not args.no_progress)
    pair_rows(rows, "full", seed=args.seed)
    if args.max_kl is not None:
        choice = frontier.choose_smallest(rows, args.max_kl, args.tolerance)
        goal = f"KL <= {args.max_kl:g} nats"
    else:
        choice = frontier.choose_at_target(rows, target_bpt, args.tolerance, seed=args.seed)
        goal = f"{target_bpt:.0f} B/token ({100 * target_bpt / fp16:.1f}% of the fp16 cache)"
    fixed = {n for n in names if not registry[n].budgets}
    table = report.format_frontier(rows, choice, fixed, target_bpt=target_bpt, tolerance=args.tolerance, seed=args.seed)
    advice = report.recommendation(choice, fixed, goal)
    out: Path = args.out
    meta: dict[str, Any] = {
        "command": ("kvbench tune " + " ".join(portable_argv(sys.argv[2:] if argv is None else argv))).strip(),
        "model": source.title,
        "dtype": dtype,
        "device": device,
        "machine": machine,
        "versions": versions(),
        "seed": args.seed,
        "text": args.text.name,
        "windows": len(windows),
        "context": args.context,
        "continuation": args.continuation,
        "tasks": tasks,
        "tasks_line": f" and {len(samples)} samples of {', '.join(tasks)}" if tasks else "",
        "fp16_bytes_per_token": fp16,
        "target_bytes_per_token": target_bpt,
        "max_kl": args.max_kl,
        "levels_bytes_per_token": level_bpt,
        "tolerance": args.tolerance,
        "methods": names,
        "dropped": [f"{d.name} {d.label}" for d in dropped],
        "estimate_s": estimate_s,
        "model_load_s": load_s,
        "cells_reused": counter.reused,
        "winner": None if choice.winner is None else choice.winner.key,
        "ties": [r.key for r in choice.ties],
        "spec": None if choice.winner is None else frontier.registry_spec(choice.winner, choice.winner.method in fixed),
        "python": None if choice.winner is None else frontier.python_line(choice.winner, choice.winner.method in fixed),
        "frontier_kl": [r.key for r in frontier.pareto(rows, "kl")],
        "frontier_accuracy": [r.key for r in frontier.pareto(rows, "accuracy")],
        "wall_s": time.perf_counter() - t0,
    }
    write_json(rows, out / "tune.json", meta)
    report.plot_frontier(
        rows,
        out / "tune.png",
        choice,
        fp16_bpt=fp16,
        target_bpt=target_bpt,
        max_kl=args.max_kl,
        title=f"{source.title}: {goal}, {len(windows)} windows of {args.context} tokens",
    )
    (out / "tune.md").write_text(report.markdown(meta, table, advice, "tune.png"))
    print(table)
    print("\n" + advice)
    print(f"\nwrote {out}/tune.json, tune.md, tune.png; wall {meta['wall_s']:.0f} s")
    print(json.dumps({"winner": meta["winner"], "spec": meta["spec"]}))
    return 0 if choice.winner is not None else 1
