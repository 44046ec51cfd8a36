"""The methods kv-hubkv registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`).

HubKV refines the scores of a base method (paper §3.3, App. A.1), so each ``hubkv-<base>`` entry looks its base up
in :mod:`kvcore.registry` when it is built (method packages never import each other): ``hubkv-snapkv`` at a budget
is ``hubkv(<the registered "snapkv">.build(budget))``, keeping the base's selector, store, protection and
granularity. A base that no installed package registers is refused with the list of what is registered.
``"hubkv"`` is HubKV over SnapKV; the paper's bases are ``hubkv-kvzip`` (KVzip's scores come from kv-hf's
reconstruction pass) and ``hubkv-fastkvzip`` (FastKVzip's trained gate, kv-baselines' ``fastkvzip``).
"""

from __future__ import annotations

from kvcore import Budget, Compressor
from kvcore import registry as kvregistry
from kvcore.registry import Method

from .compressor import hubkv

__all__ = ["METHODS", "over"]

BASE_BUDGETS = frozenset({"ratio", "tokens"})
"""Budget kinds of the registered bases (SnapKV, H2O, KVzip, FastKVzip); a test checks they match the bases' own."""


def over(base: str, name: str | None = None) -> Method:
    """The registry entry ``hubkv-<base>``: HubKV over the method registered as ``base``.

    Parameters
    ----------
    base : str
        Registered name of the base method (``"snapkv"``, ``"h2o"``, ``"kvzip"``, ``"fastkvzip"``).
    name : str, optional
        Registry name; ``"hubkv-<base>"`` if omitted.

    Returns
    -------
    kvcore.registry.Method
        Its factory raises ``LookupError`` listing the registered methods when ``base`` is not registered, and
        ``ValueError`` when the base does not take the budget.
    """
    if not isinstance(base, str) or not base:
        raise ValueError(f"base must be a non-empty method name, got {base!r}")

    def make(budget: Budget) -> Compressor:
        try:
            base_method = kvregistry.get(base)
        except LookupError as exc:
            raise LookupError(f"HubKV over {base!r}: {exc}") from None
        return hubkv(base_method.build(budget))

    make.__name__ = f"hubkv_{base}"
    return Method(
        name or f"hubkv-{base}",
        make,
        f"HubKV submodular refinement of the registered {base!r} scores (HubKV §3.3)",
        budgets=BASE_BUDGETS,
    )


METHODS: tuple[Method, ...] = (
    over("snapkv", name="hubkv"),
    over("snapkv"),
    over("h2o"),
    over("kvzip"),
    over("fastkvzip"),
)
