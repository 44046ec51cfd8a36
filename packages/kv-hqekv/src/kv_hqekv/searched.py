"""Tier shares searched for the models kvbench evaluates, shipped with the package (HqeKV §3.3, Alg. 1).

The paper's Table 9 shares were searched on Llama-3.1-8B-Instruct and Qwen3-8B. The files in
``kv_hqekv/searched/`` were written by kv-lab's ``kv-hqekv search`` (TPE over Eq. 3's free shares on a calibration
window held out of kvbench's evaluation text) for the offline models; each keeps the search's settings beside the
shares, so a result can be traced to the command that produced it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kv_hqekv.shares import Shares

SEARCHED_DIR = Path(__file__).resolve().parent / "searched"
"""Where the shipped search results live (``<model>-<bits>.json``, as ``kv-hqekv search --out`` writes them)."""


def searched_names() -> list[str]:
    """Names of the shipped search results (``"smollm2-2"``, ...), sorted."""
    return sorted(p.stem for p in SEARCHED_DIR.glob("*.json"))


def _data(name: str) -> dict:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    path = SEARCHED_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"kv-hqekv ships no searched shares named {name!r}; shipped: {searched_names()}")
    return json.loads(path.read_text())


def searched(name: str) -> Shares:
    """The shares of the shipped search result ``name`` (``ValueError`` lists the shipped names)."""
    return Shares(**_data(name)["shares"])


def search_settings(name: str) -> dict:
    """The settings the search ran with (bits, trials, seed, model, context, calibration text, ...)."""
    return dict(_data(name)["settings"])
