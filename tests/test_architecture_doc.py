"""docs/architecture.md's layout lists exactly the workspace's members (a new member must be documented there)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def workspace_members() -> set[str]:
    """Member folders the root pyproject's workspace globs match (each holding a pyproject.toml)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    return {str(p.parent.relative_to(ROOT)) for pattern in globs for p in ROOT.glob(f"{pattern}/pyproject.toml")}


def documented_members() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text.split("## 1. Layout and dependency rules", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    return {m.group(1) for m in re.finditer(r"^((?:core|packages|integrations|tools)/[\w.-]+)/", layout, re.M)}


def test_the_layout_lists_every_member_and_nothing_else():
    members = workspace_members()
    assert len(members) >= 13  # core, methods, integrations, tools: a glob that matched nothing would pass vacuously
    assert documented_members() == members
