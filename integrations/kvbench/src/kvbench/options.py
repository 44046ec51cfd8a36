"""Options and helpers shared by the ``kvbench`` commands (``kvbench`` and ``kvbench tune``): whole-number and
positive arguments with one-line errors, the run options every command that loads a model takes, the device checks,
the versions recorded in results, the portable command line and the reused-cell counter."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = [
    "UsageError",
    "add_run_options",
    "check_device",
    "device_and_dtype",
    "portable_argv",
    "versions",
]


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    return parse


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_run_options(ap: argparse.ArgumentParser, out: Path) -> None:
    """The options of every kvbench command that runs a model: ``--dtype``, ``--device``, ``--seed``, ``--out``
    (default ``out``), ``--fresh`` and ``--no-progress``."""
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype; auto is bfloat16 on CUDA, float32 on CPU (default: %(default)s)",
    )
    ap.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available, else cpu)")
    ap.add_argument("--seed", type=int, default=0, help="task, window and bootstrap seed (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=out, help="output folder (default: %(default)s)")
    ap.add_argument("--fresh", action="store_true", help="recompute every cell, ignoring finished ones in --out/cells")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


class UsageError(ValueError):
    """A bad option value: printed as one line, exit status 2."""


def check_device(device: str | None) -> None:
    """Raise :class:`UsageError` unless ``--device`` is ``None``, ``cpu`` or an available ``cuda[:i]``."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: {device!r} is not a device; use cpu or cuda[:i]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: {device!r}; use cpu or cuda[:i]")


def device_and_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """``--device`` and ``--dtype`` with their defaults filled: cuda when available, bfloat16 on CUDA, float32 on
    CPU."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return device, dtype


def versions() -> dict[str, str]:
    """Versions of the packages a result depends on (method packages included, found through entry points)."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    names = {"kvbench", "kvcore", "kvcodec", "kv-hf", "torch", "transformers", "numpy"}
    for ep in entry_points(group="kvcompress.methods"):
        if ep.dist is not None:
            names.add(ep.dist.name)
    out = {}
    for n in sorted(names):
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            continue
    return out


def portable_argv(argv: list[str]) -> list[str]:
    """The command line as recorded in results: an absolute ``--out`` folder under the working directory is
    written relative to it, and one elsewhere by its name alone, so committed results name no local path."""
    out, nxt = [], False
    for a in argv:
        if nxt or a.startswith("--out="):
            prefix, path = ("", a) if nxt else ("--out=", a.removeprefix("--out="))
            p = Path(path)
            if p.is_absolute():
                try:
                    p = p.relative_to(Path.cwd())
                except ValueError:
                    p = Path(p.name)
            a = prefix + str(p)
        nxt = a == "--out"
        out.append(a)
    return out


class _Counting:
    """Counts the finished cells a run reuses (for the report)."""

    def __init__(self, inner) -> None:
        self.inner, self.reused, self._seen = inner, 0, set()
        self.compute_s: dict[str, float] = {}  # seconds each cell took when it was computed (this run or earlier)

    def get(self, cell):
        found = self.inner.get(cell)
        key = json.dumps(cell, sort_keys=True)
        if found is not None and key not in self._seen and not cell.get("partial"):
            self.reused += 1
            self._seen.add(key)
            self.compute_s[key] = float(found.get("elapsed_s", 0.0))
        return found

    def put(self, cell, result):
        if cell.get("partial"):  # progress inside a cell, not a finished one
            self.inner.put(cell, result)
            return
        key = json.dumps(cell, sort_keys=True)
        self._seen.add(key)
        self.compute_s[key] = float(result.get("elapsed_s", 0.0))
        self.inner.put(cell, result)

    def discard(self, cell):
        self.inner.discard(cell)
