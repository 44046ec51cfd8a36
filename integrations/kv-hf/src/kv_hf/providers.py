"""Named providers of ``ScoringContext.extras``: inputs a scorer declares in ``needs_extras`` that only an engine
adapter can compute, because they need extra forward passes of the model.

A scorer declares the extras it reads by name (``kvcore.Scorer.needs_extras``); :func:`kv_hf.prefill` runs the
provider registered here under each name after the prompt is collected and before it is compressed, and refuses a
name no provider supplies. The adapter has no method-specific branch, and this registry imports no provider: the
providers register themselves (:func:`register`) and are found

* built in: ``"kvzip_scores"`` — KVzip's context-reconstruction pass (Kim et al. 2025, arXiv:2505.23416;
  :mod:`kv_hf.reconstruction`) and ``"surprisal"`` — token surprisal from the prefill's own hidden states (SEKV,
  Eq. 1; :mod:`kv_hf.surprisal`), registered when ``kv_hf`` is imported;
* from installed packages, through the entry-point group :data:`ENTRY_POINT_GROUP` (``kvcompress.hf_providers``):
  each entry point, named after the extra it supplies, loads a :class:`Provider`. A method package whose scorer
  needs the model for a new extra ships its provider that way, with no change to kv-hf::

      [project.entry-points."kvcompress.hf_providers"]
      my_extra = "my_method.hf:PROVIDER"

  Entry points are read once, on the first lookup.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvcore import Compressor

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvcompress.hf_providers"
"""Entry-point group through which installed packages supply extras providers."""


@dataclass(frozen=True)
class Provider:
    """How :func:`kv_hf.prefill` computes one named extra.

    Parameters
    ----------
    name : str
        The ``ScoringContext.extras`` key it supplies (what a scorer lists in ``needs_extras``).
    option : str
        Keyword of :func:`kv_hf.prefill` carrying the provider's configuration (``None`` = its defaults).
    check : callable
        ``check(cache, input_ids, attention_mask, tokenizer)``; raises ``ValueError`` before any forward pass when
        the provider cannot run on this input (batch size, padding, missing tokenizer ...).
    run : callable
        ``run(model, cache, input_ids, *, tokenizer, context_start, config) -> {layer_idx: {name: tensor}}``, called
        once the prompt is collected raw in ``cache``; the tensors are aligned with each layer's collected tokens.
    description : str
        What it runs and what it needs (used in error messages).
    capture : callable, optional
        ``capture(model)`` -> a context manager that :func:`kv_hf.prefill` holds open around the prefill's forward
        passes; what it yields is passed to ``run`` as ``captured=`` (with ``attention_mask=``), so a provider can
        read the prefill's own activations instead of running the model again.
    """

    name: str
    option: str
    check: Callable[..., None]
    run: Callable[..., Mapping[int, Mapping[str, Any]]]
    description: str
    capture: Callable[[Any], AbstractContextManager[Any]] | None = None


PROVIDERS: dict[str, Provider] = {}
"""Extras kv-hf can supply, by name (built-in providers and those from entry points, once discovered)."""

_discovered = False
_discover_lock = threading.Lock()


def register(provider: Provider) -> Provider:
    """Register ``provider`` under its name (a module of kv-hf or of a method package calls this at import).

    Raises ``TypeError`` for a non-:class:`Provider`, ``ValueError`` when another provider already has the name.
    """
    if not isinstance(provider, Provider):
        raise TypeError(f"provider must be a kv_hf.providers.Provider, got {type(provider).__name__}")
    held = PROVIDERS.get(provider.name)
    if held is not None and held is not provider:
        raise ValueError(f"an extras provider named {provider.name!r} is already registered ({held.description})")
    PROVIDERS[provider.name] = provider
    return provider


def _entry_points() -> list[Any]:
    return list(entry_points(group=ENTRY_POINT_GROUP))


def discover() -> dict[str, Provider]:
    """Load the providers installed packages declare under :data:`ENTRY_POINT_GROUP` (once) and return the registry.

    An entry point must be named after the extra it supplies and load a :class:`Provider` of that name; one that
    fails to load is skipped with a warning naming it (a broken plugin must not break kv-hf).
    """
    global _discovered
    with _discover_lock:
        if _discovered:
            return PROVIDERS
        for ep in _entry_points():
            try:
                provider = ep.load()
                if not isinstance(provider, Provider) or provider.name != ep.name:
                    raise TypeError(
                        f"entry point {ep.name!r} must load a kv_hf.providers.Provider named {ep.name!r}, got "
                        f"{provider!r}"
                    )
                if PROVIDERS.get(ep.name) is not provider:
                    register(provider)
            except Exception as exc:
                logger.warning("kv_hf: extras provider %r (%s) not loaded: %s", ep.name, ep.value, exc)
        _discovered = True
    return PROVIDERS


def provided() -> frozenset[str]:
    """Names of the extras kv-hf supplies."""
    return frozenset(discover())


def options() -> frozenset[str]:
    """Keywords of :func:`kv_hf.prefill` that configure a provider."""
    return frozenset(p.option for p in discover().values())


def providers_for(names: Iterable[str]) -> list[Provider]:
    """The providers of ``names`` (sorted); ``ValueError`` naming what kv-hf provides for an unknown name."""
    names = sorted(set(names))
    discover()
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"no kv_hf provider supplies the extras {unknown}; kv_hf provides {describe()}")
    return [PROVIDERS[n] for n in names]


def describe() -> str:
    """``name (description)`` of every provider, for error messages."""
    return "; ".join(f"{p.name!r}: {p.description}" for p in discover().values()) or "nothing"


def run_providers(
    providers: list[Provider],
    model: Any,
    cache: Any,
    input_ids: torch.Tensor,
    *,
    tokenizer: Any,
    context_start: int,
    configs: Mapping[str, Any],
    captured: Mapping[str, Any] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict[int, dict[str, Any]]:
    """Run ``providers`` and merge their per-layer extras into ``{layer_idx: {name: tensor}}``; a provider with a
    ``capture`` gets what it captured during the prefill (``captured[name]``) and the attention mask."""
    out: dict[int, dict[str, Any]] = {}
    for p in providers:
        extra = {} if p.capture is None else {"captured": (captured or {})[p.name], "attention_mask": attention_mask}
        result = p.run(
            model,
            cache,
            input_ids,
            tokenizer=tokenizer,
            context_start=context_start,
            config=configs.get(p.option),
            **extra,
        )
        for layer_idx, extras in result.items():
            out.setdefault(layer_idx, {}).update(extras)
    return out


def missing_message(compressor: Compressor, missing: list[str], query_window: int | None) -> str:
    """Why a scorer's declared inputs are missing, and how kv-hf supplies each of them."""
    discover()
    hints = []
    if "queries" in missing:
        hints.append(
            "queries: kv_hf captures the last `query_window` post-RoPE query states "
            f"(query_window={query_window}); none were captured for this layer yet"
        )
    for name in missing:
        if name in PROVIDERS:
            hints.append(
                f"{name}: compress with kv_hf.prefill(model, cache, ids, ...), which runs {PROVIDERS[name].description}"
            )
    other = [m for m in missing if m != "queries" and m not in PROVIDERS]
    if other:
        hints.append(f"{other}: kv_hf cannot supply these")
    name = type(compressor.scorer).__name__
    return f"scorer {name} needs {missing}, which the kv_hf adapter did not provide ({'; '.join(hints)})"
