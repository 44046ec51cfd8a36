"""The ``kvbench`` command: evaluate registered KV-cache compression methods on a real model, offline.

Every option is checked before the model is loaded; a wrong name or number is a one-line error that lists what is
allowed (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvbench.budgets import SYNTAX, parse_budgets
from kvbench.compare import parse_comparisons, validate_comparisons
from kvbench.methods import describe, parse_methods, plan_grid
from kvbench.models.registry import DEFAULT_MODEL, MODELS, describe_models, get_model
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
from kvbench.profiles import PROFILES

DEFAULT_METHODS = "streaming_llm,snapkv,knorm,kivi-4@0,kivi-2@0"
"""The default run: evictions at every budget, plain KIVI (ratio 0; KIVI above 0 adds SnapKV eviction)."""

DEFAULT_BUDGETS = "0.5,0.75,0.9"

DESCRIPTION = f"""\
Evaluate registered KV-cache compression methods on a real model, offline (SmolLM2-135M-Instruct unless --model
names another; see --list-models): generated long-context
retrieval tasks (accuracy per sample), teacher-forced continuation KL against the full cache (per window), the KV
bytes each cache really holds, and timings. Every row is paired with its reference (the full cache, or
--reference) on the same samples and windows; the mean paired difference carries a seeded bootstrap 95%
confidence interval, and '*' marks a difference whose interval excludes zero (with at least 10 pairs).

The default run (no options, profile quick) compares the full cache, StreamingLLM, SnapKV and Knorm at ratios
0.5 / 0.75 / 0.9 and KIVI-4 / KIVI-2 at ratio 0: about two minutes on an idle 2-core CPU (126 s measured
2026-11-27, loading the model included).
Profile quick: {PROFILES["quick"].describe()}.
Profile paper: {PROFILES["paper"].describe()}.

Budgets: {SYNTAX}.
Results go to --out: kvbench.json, kvbench_accuracy.png, kvbench_kl.png, report.md and cells/ (one file per
finished cell; a rerun with the same options skips them).

kvbench tune --model M --text FILE --target 0.25: the best method and budget for a memory target on your own model
and text (kvbench tune --help).
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers like 1000,2000, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.2,0.5, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvbench", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    q, p = PROFILES["quick"], PROFILES["paper"]

    def prof(field: str, fmt=str) -> str:
        return f"(default: from --profile; quick {fmt(getattr(q, field))}, paper {fmt(getattr(p, field))})"

    def seq(x) -> str:
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in x)

    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick", help="run size (default: %(default)s)")
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model to evaluate on, one of {', '.join(MODELS)} (see --list-models; default: %(default)s)",
    )
    ap.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated registered names (see --list); name@b1/b2 runs a method at its own budgets "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--budgets",
        "--ratios",
        dest="budgets",
        default=DEFAULT_BUDGETS,
        help="budgets every method runs at when it takes their kind: ratio 0.5, tokens 256t, average bits 2.5bits, "
        "bytes per token 4096bpt (default: %(default)s)",
    )
    ap.add_argument(
        "--match-bytes",
        type=_positive,
        default=None,
        metavar="X",
        help="instead of --budgets, run each method at the budget whose held bytes come closest to X bytes per "
        "token (X > 1) or X times an fp16 cache (0 < X <= 1), searched over the budgets its registry entry takes "
        "(default: off)",
    )
    ap.add_argument(
        "--protocol",
        choices=["agnostic", "aware", "both"],
        default="agnostic",
        help="agnostic: context compressed before the question; aware: question in the prompt at compression "
        "time (default: %(default)s)",
    )
    ap.add_argument(
        "--reference",
        default="full",
        help="method each row is paired with, at the same budget and protocol (default: %(default)s)",
    )
    ap.add_argument(
        "--compare",
        default=None,
        metavar="A:B,...",
        help="head-to-head pairs reported as A − B on the same samples and windows, whatever their budgets; a side "
        "is a method or method@budget (needed when it runs at several), e.g. hqekv-2:kivi-2@0,hex-3:kcvt-3 "
        "(default: none)",
    )
    ap.add_argument("--tasks", default=None, help=f"comma-separated task names {prof('tasks')}")
    ap.add_argument("--lengths", type=_int_list, default=None, help=f"context lengths in tokens {prof('lengths', seq)}")
    ap.add_argument("--depths", type=_float_list, default=None, help=f"needle depths in [0, 1] {prof('depths', seq)}")
    ap.add_argument(
        "--samples", type=_count(1), default=None, help=f"samples per (task, length, depth) {prof('samples')}"
    )
    ap.add_argument("--kl-samples", type=_count(0), default=None, help=f"continuation windows {prof('kl_samples')}")
    ap.add_argument("--kl-context", type=_count(1), default=None, help=f"window context tokens {prof('kl_context')}")
    ap.add_argument(
        "--kl-continuation", type=_count(2), default=None, help=f"window continuation tokens {prof('kl_continuation')}"
    )
    add_run_options(ap, Path("results"))
    ap.add_argument("--list", action="store_true", help="list registered methods (budget kinds, description) and exit")
    ap.add_argument("--list-tasks", action="store_true", help="list the task names and exit")
    ap.add_argument("--list-models", action="store_true", help="list the models --model takes and exit")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and fill the profile's defaults (no registry or model is touched)."""
    args = build_parser().parse_args(argv)
    prof = PROFILES[args.profile]
    for name in ("tasks", "samples", "kl_samples", "kl_context", "kl_continuation"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(prof, name))
    if args.lengths is None:
        args.lengths = list(prof.lengths)
    if args.depths is None:
        args.depths = list(prof.depths)
    return args


def validate(args: argparse.Namespace, registry: dict) -> tuple[list, list[str], list[str]]:
    """Check every option against the registry and the task list; returns (grid, tasks, protocols).

    Raises
    ------
    UsageError
        Naming the option and what it allows.
    """
    from kvbench.tasks import TASKS

    try:
        get_model(args.model)
    except ValueError:
        raise UsageError(f"--model: unknown model {args.model!r}; known: {', '.join(MODELS)}") from None
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"--tasks: unknown task(s) {unknown}; valid: {', '.join(sorted(TASKS))}")
    try:
        budgets = parse_budgets(args.budgets, "--budgets")
        specs = parse_methods(args.methods)
        if args.match_bytes is not None:
            from kvbench.budgets import BudgetSpec
            from kvbench.methods import MethodSpec

            specs = [MethodSpec(s.name) for s in specs]
            budgets = [BudgetSpec("bytes_per_token", args.match_bytes)]  # fractions are converted after loading
        grid = plan_grid(registry, specs, budgets)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.reference not in registry:
        raise UsageError(f"--reference: unknown method {args.reference!r}; registered: {', '.join(sorted(registry))}")
    if args.reference != "full" and args.reference not in {g.name for g in grid}:
        raise UsageError(f"--reference {args.reference!r} must also be among --methods")
    try:
        args.comparisons = parse_comparisons(args.compare)
        validate_comparisons(args.comparisons, grid)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_device(args.device)
    if args.kl_samples and args.kl_context < 2:
        raise UsageError("--kl-context must be >= 2 tokens")
    protocols = ["agnostic", "aware"] if args.protocol == "both" else [args.protocol]
    return grid, tasks, protocols


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["tune"]:
        from kvbench.tune.cli import main as tune

        return tune(words[1:])
    args = parse_args(argv)
    if args.list_models:
        print(describe_models())
        return 0
    from kvcore.registry import discover

    registry = discover()
    if args.list:
        print(describe(registry))
        return 0
    if args.list_tasks:
        from kvbench.tasks import TASKS

        print("\n".join(sorted(TASKS)))
        return 0
    try:
        grid, tasks, protocols = validate(args, registry)
    except UsageError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr)
        return 2
    return _run(args, argv, registry, grid, tasks, protocols)


def _run(args, argv, registry, grid, tasks, protocols) -> int:
    import torch

    from kvbench.cells import CellCache
    from kvbench.compare import compare_rows
    from kvbench.methods import GridItem
    from kvbench.paired import pair_rows
    from kvbench.report import format_table, markdown_report, plot, write_json
    from kvbench.run import Workload, code_changed, describe_machine, fp16_bytes_per_token, method_code, run_grid
    from kvbench.tasks import continuation_split, lee_background, make_tasks

    device, dtype = device_and_dtype(args)
    machine = describe_machine(device)
    t0 = time.perf_counter()
    entry = get_model(args.model)
    model, tok = entry.load(dtype=getattr(torch, dtype), device=device)
    load_s = time.perf_counter() - t0
    if args.match_bytes is not None and args.match_bytes <= 1.0:  # a fraction of an fp16 cache
        bpt = args.match_bytes * fp16_bytes_per_token(model)
        grid = [
            GridItem(g.name, g.budget, None if g.target is None else type(g.target)(g.target.kind, bpt)) for g in grid
        ]
    samples = make_tasks(tasks, args.lengths, args.depths, args.samples, tok, seed=args.seed)
    pairs = (
        list(
            continuation_split(
                lee_background(part="evaluation"),
                tok,
                args.kl_context,
                args.kl_continuation,
                args.kl_samples,
                seed=args.seed,
            )
        )
        if args.kl_samples
        else []
    )
    work = Workload(samples, pairs)
    context = {"model": entry.title, "dtype": dtype, "device": device, "work": work.fingerprint()}
    if args.fresh:
        context["fresh"] = time.time()
    cells = CellCache(args.out / "cells", context)
    counter = _Counting(cells)
    code = {name: method_code(registry[name]) for name in sorted({g.name for g in grid} | {"full"})}
    rows = run_grid(model, tok, registry, grid, work, protocols=protocols, cache=counter, progress=not args.no_progress)
    edited = code_changed(registry, code)
    if edited:
        print(
            f"kvbench: warning: the code of {', '.join(edited)} changed while this run was going; their cells may mix "
            "old and new code -- rerun the command to recompute them with the code as it is now",
            file=sys.stderr,
        )
    pair_rows(rows, args.reference, seed=args.seed)
    comparisons = compare_rows(rows, args.comparisons, seed=args.seed)
    command = "kvbench " + " ".join(portable_argv(sys.argv[1:] if argv is None else argv))
    meta: dict[str, Any] = {
        "command": command.strip(),
        "profile": args.profile,
        "protocols": protocols,
        "reference": args.reference,
        "model": entry.title,
        "dtype": dtype,
        "device": device,
        "machine": machine,
        "versions": versions(),
        "seed": args.seed,
        "model_load_s": load_s,
        "tasks": tasks,
        "lengths": args.lengths,
        "depths": args.depths,
        "samples": len(samples),
        "kl_pairs": len(pairs),
        "kl_context": args.kl_context,
        "kl_continuation": args.kl_continuation,
        "fp16_bytes_per_token": fp16_bytes_per_token(model),
        "cells_reused": counter.reused,
        "code": code,
        "code_changed_during_run": edited,
        "cells_compute_s": sum(counter.compute_s.values()),  # reused cells count the time they took when computed
        "wall_s": time.perf_counter() - t0,
    }
    out = args.out
    write_json(rows, out / "kvbench.json", meta, comparisons)
    title = f"{entry.short}, {','.join(tasks)} @ {','.join(map(str, args.lengths))} tokens, ref {args.reference}"
    plots = []
    for metric in ("accuracy", "kl"):
        name = f"kvbench_{metric}.png"
        plot(rows, out / name, metric=metric, title=title)
        plots.append(name)
    (out / "report.md").write_text(markdown_report(rows, meta, plots, comparisons))
    print(format_table(rows))
    if comparisons:
        from kvbench.compare import format_comparisons

        print("\n" + format_comparisons(comparisons))
    print(f"\nwrote {out}/kvbench.json, report.md, {', '.join(plots)}; wall {meta['wall_s']:.0f} s")
    print(json.dumps(machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
