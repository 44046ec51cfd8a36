"""Relative links in the docs resolve: the file exists and, for a Markdown target, so does the anchor (an explicit
``<a name=...>`` or a heading's GitHub slug). docs/benchmarks.md is an index over the dated records in docs/results/:
every record is linked from it, and the anchors of the old one-page log still land on it."""

from __future__ import annotations

import re
from functools import cache
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
CODE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: tags dropped, lower case, punctuation but ``-`` and ``_`` removed."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    found, seen = set(), {}
    for line in CODE.sub("", path.read_text()).splitlines():
        found |= set(re.findall(r'<a (?:name|id)="([^"]+)"', line))
        if m := re.match(r"^#{1,6} (.*)", line):
            s = slug(m.group(1))
            found.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return frozenset(found)


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(CODE.sub("", path.read_text())) if not t.startswith(("http:", "https:", "mailto:"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no such anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_benchmarks_index_links_every_record() -> None:
    index = ROOT / "docs" / "benchmarks.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    records = set((ROOT / "docs" / "results").glob("*.md"))
    assert records, "docs/results/ holds no record"
    missing = sorted(p.name for p in records - linked)
    assert not missing, f"docs/results records not linked from docs/benchmarks.md: {missing}"


def test_the_old_benchmarks_anchors_land_on_the_index() -> None:
    """Links into the one-page log (``benchmarks.md#gpu-h200-2``) predate the split; each anchor is kept on the
    index, next to the link to where its section went."""
    old = {"wheels", "gpu-h200", "gpu-h200-2", "decode-census", "method-tables", "hex-kv-hex", "sekv-2k", "kivi-decode"}
    assert old <= anchors(ROOT / "docs" / "benchmarks.md")
