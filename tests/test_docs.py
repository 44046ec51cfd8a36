"""Every Python code block in README.md, docs/ and the members' READMEs runs, so the docs cannot rot.

The blocks of one Markdown file run in order in one fresh interpreter (a later block may use what an earlier one
defined), from a temporary directory. Shell blocks are checked where they name our own CLIs: every ``kvbench``
command line must parse with kvbench's own argument parser and pass the checks it runs before loading the model
(running the benchmark itself takes minutes; a ``kvbench tune`` line, the checks that need neither its model nor
its text file); every ``kv-sekv`` line must parse with its parser.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *ROOT.glob("core/*/README.md"),
        *ROOT.glob("packages/*/README.md"),
        *ROOT.glob("integrations/*/README.md"),
        *ROOT.glob("tools/*/README.md"),
    ]
)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(path: Path, languages: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang in languages]


def with_python(path: Path) -> list[Path]:
    return [p for p in DOCS if blocks(p, ("python",))]


@pytest.mark.parametrize("path", with_python(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, tmp_path: Path) -> None:
    script = "\n\n".join(blocks(path, ("python",)))
    (tmp_path / "doc_blocks.py").write_text(script)
    run = subprocess.run([sys.executable, "doc_blocks.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (
        f"{path.relative_to(ROOT)}: a code block failed\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    )


def kvbench_lines(cli: str = "kvbench") -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for body in blocks(path, ("bash", "sh", "console", "shell")):
            for line in body.replace("\\\n", " ").splitlines():  # a continued line is one command, as in a shell
                line = line.split("#", 1)[0].strip()
                words = shlex.split(line) if line else []
                if words[:2] == ["uv", "run"]:
                    words = words[2:]
                if words[:1] == [cli]:
                    out.append((str(path.relative_to(ROOT)), line))
    return out


def test_the_docs_show_kvbench_commands() -> None:
    assert kvbench_lines(), "no kvbench command found in the docs (the README's main job)"


@pytest.mark.parametrize("where, line", kvbench_lines())
def test_kvbench_command_lines_parse(where: str, line: str) -> None:
    from kvbench.cli import UsageError, parse_args, validate
    from kvcore.registry import discover

    words = shlex.split(line)
    args = words[words.index("kvbench") + 1 :]
    if "--help" in args or "-h" in args:
        return
    if args[:1] == ["tune"]:  # kvbench tune: its options and the checks that need neither the model nor the text
        from kvbench.tune import cli as tune

        try:
            tune.validate(tune.parse_args(args[1:]), discover(), files=False)
        except SystemExit as e:
            pytest.fail(f"{where}: `{line}` does not parse with kvbench tune's options (exit {e.code})")
        except UsageError as e:
            pytest.fail(f"{where}: `{line}` is refused by kvbench tune: {e}")
        return
    try:
        parsed = parse_args(args)
    except SystemExit as e:  # argparse exits on a bad option
        pytest.fail(f"{where}: `{line}` does not parse with kvbench's options (exit {e.code})")
    if parsed.list or parsed.list_tasks:
        return
    try:  # the checks kvbench runs before loading the model: methods, budgets, tasks, --compare sides ...
        validate(parsed, discover())
    except UsageError as e:
        pytest.fail(f"{where}: `{line}` is refused by kvbench: {e}")


def test_the_default_run_time_is_stated_alike_everywhere() -> None:
    """``kvbench --help`` states the default run's measured time; the benchmarks page and kvbench's README (and the
    profiles' docstring) must state the same figure, so a re-measurement changed in one place fails here."""
    from kvbench.cli import DESCRIPTION

    measured = re.search(r"\((\d+) s measured", DESCRIPTION)
    assert measured, "kvbench --help must state the default run's measured time"
    figure = f"{measured.group(1)} s measured"
    for doc in (
        ROOT / "docs" / "benchmarks.md",
        ROOT / "integrations" / "kvbench" / "README.md",
        ROOT / "integrations" / "kvbench" / "src" / "kvbench" / "profiles.py",
    ):
        assert figure in doc.read_text(), f"{doc.relative_to(ROOT)} does not state '{figure}'"


@pytest.mark.parametrize("where, line", kvbench_lines("kv-sekv"))
def test_kv_sekv_command_lines_parse(where: str, line: str) -> None:
    from kv_lab.sekv.cli import parser

    try:
        parser().parse_args(shlex.split(line)[1:])
    except SystemExit as e:
        pytest.fail(f"{where}: `{line}` does not parse with kv-sekv's options (exit {e.code})")
