"""Fused attention over a store: the optional ``AttendingStore`` capability of a :class:`kvcore.Store`.

A store declares it with ``can_attend = True`` (a class attribute of the :class:`~kvcore.Store` protocol) and
implements ``attend(query, scale=None) -> (out, lse)``. Adapters and the conformance suites read the declaration
through :func:`attends`, which refuses a store that declares the capability without the method.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

__all__ = ["AttendingStore", "attends"]


@runtime_checkable
class AttendingStore(Protocol):
    """A store with fused attention over what it holds (optional capability of a :class:`kvcore.Store`).

    Attributes
    ----------
    can_attend : bool
        ``True``: the declaration adapters read (through :func:`attends`) to decode through :meth:`attend`
        instead of attending over ``read(query)``.
    """

    can_attend: ClassVar[bool]

    def attend(self, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query`` over the held entries, equal (fp32 tolerance) to
        :func:`kvcore.reference_attention` over ``read(query)``.

        Parameters
        ----------
        query : torch.Tensor
            ``[B, Hq, Q, D]`` floating point, ``Hq`` a multiple of the store's ``Hkv`` (query head ``j`` reads KV
            head ``j // (Hq // Hkv)``).
        scale : float, optional
            Logit scale, positive and finite; ``None`` is ``1 / sqrt(D)``.

        Returns
        -------
        out : torch.Tensor
            ``[B, Hq, Q, D]``; ``0`` on a head that holds no entry.
        lse : torch.Tensor
            ``[B, Hq, Q]`` float32 natural-log log-sum-exp of the logits; ``-inf`` on a head that holds no entry.

        Raises
        ------
        ValueError, TypeError
            A query of another batch or head dim, ``Hq`` not a multiple of ``Hkv``, an integer dtype, a rank other
            than 4, or a non-positive scale (checked before any kernel runs).
        """
        ...


def attends(store: object) -> bool:
    """Whether ``store`` declares fused attention (``can_attend``), checking that it can honour the declaration.

    Parameters
    ----------
    store : kvcore.Store
        The store an adapter decodes over, or that a suite tests.

    Returns
    -------
    bool
        ``store.can_attend``: ``True`` when the store implements :class:`AttendingStore`.

    Raises
    ------
    TypeError
        ``can_attend`` is not a bool, or is ``True`` on a store without a callable ``attend`` method (a declared
        capability the adapter would fail on at the first decode step).

    Examples
    --------
    >>> import kvcore
    >>> kvcore.attends(kvcore.DenseStore())
    False
    """
    if not _declared_can_attend(store):
        return False
    if not isinstance(store, AttendingStore) or not callable(store.attend):
        raise TypeError(
            f"{type(store).__name__} declares can_attend = True but has no attend(query, scale=None) method: "
            "implement kvcore.AttendingStore or declare can_attend = False"
        )
    return True


def _declared_can_attend(store: object) -> bool:
    """``can_attend`` as the class declares it (inherited from a base, such as the kvcore.Store protocol)."""
    for cls in type(store).__mro__:
        if "can_attend" in cls.__dict__:
            value = cls.__dict__["can_attend"]
            if not isinstance(value, bool):
                raise TypeError(f"{type(store).__name__}.can_attend must be a bool class attribute, got {value!r}")
            return value
    return False
