"""Argument checks shared by kvcore value types, references and method packages (public API).

Every check raises ``ValueError`` or ``TypeError`` naming the argument and what is allowed, so bad input
never turns into NaN or a silently wrong shape further down the pipeline.

**Value checks on accelerators.** A check that reads tensor *values* (finiteness, the order of positions) waits
on a GPU for every kernel queued before it -- a host sync. Once per compression that is noise; once per layer per
decode step it makes a small model's decode run at the launch latency of the whole model. So the per-step checks
(:func:`check_append`, what ``Store.append`` runs) read values only where :func:`values_checked` says so: always
for CPU tensors, and for accelerator tensors only inside :func:`value_checks` ``(True)`` or with the environment
variable ``KVCORE_VALUE_CHECKS=1`` (the conformance suites turn them on). Shape, dtype and device checks always run,
and ``write``/``retier`` always check values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from numbers import Integral, Real

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, x: object, *, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Return ``x`` if it is a tensor with the expected rank, else raise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if x.ndim not in allowed:
            raise ValueError(f"{name} must have rank {' or '.join(map(str, allowed))}, got shape {tuple(x.shape)}")
    return x


def check_float(name: str, x: torch.Tensor) -> torch.Tensor:
    """Require a floating dtype kvcore supports (fp32, fp16, bf16)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    return x


def check_finite(name: str, x: torch.Tensor) -> torch.Tensor:
    """Reject NaN and +-inf."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite (found NaN or inf)")
    return x


def check_kv(
    keys: object, values: object, *, held: tuple[int, int, int, torch.dtype] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[B, H, T, D]`` keys and values of one dtype, shape and device (what every Store's ``write`` and
    ``append`` take); with ``held = (B, H, D, dtype)`` of a non-empty store, also matching the held cache."""
    check_float("keys", check_tensor("keys", keys, ndim=4))
    check_tensor("values", values, ndim=4)
    if values.shape != keys.shape or values.dtype != keys.dtype or values.device != keys.device:
        raise ValueError(
            f"values {values.dtype} {tuple(values.shape)} must match keys {keys.dtype} {tuple(keys.shape)}"
        )
    if held is not None:
        B, H, D, dtype = held
        if keys.shape[:2] != (B, H) or keys.shape[-1] != D or keys.dtype != dtype:
            raise ValueError(
                f"keys {keys.dtype} {tuple(keys.shape)} do not match the stored cache [B={B}, H={H}, *, D={D}] {dtype}"
            )
    return keys, values


def check_bool_mask(name: str, mask: object, shape: tuple[int, ...]) -> torch.Tensor:
    """Return a bool mask broadcast to ``shape``."""
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}")
    try:
        return mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to {shape}") from None


def check_ratio(name: str, ratio: object) -> float:
    """A compression ratio: fraction removed, in [0, 1)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(ratio).__name__}")
    ratio = float(ratio)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (fraction removed), got {ratio}")
    return ratio


def _bounds(low: float | None, high: float | None) -> str:
    """``>= low``, ``<= high`` or ``in [low, high]``."""
    if high is None:
        return f">= {low}"
    return f"<= {high}" if low is None else f"in [{low}, {high}]"


def check_int(
    name: str,
    value: object,
    *,
    low: int | None = None,
    high: int | None = None,
    choices: Iterable[int] | None = None,
    optional: str | None = None,
) -> int | None:
    """An integer (``int`` or any ``numbers.Integral`` such as a NumPy integer, not a bool) in ``[low, high]``;
    returned as ``int``.

    Parameters
    ----------
    name : str
        The argument's name, as the error message shows it.
    value : object
        The value to check.
    low, high : int, optional
        Inclusive bounds.
    choices : iterable of int, optional
        The allowed values (for widths such as ``bits``), shown sorted in the error.
    optional : str, optional
        When given, ``None`` is allowed and returned as is; the string says what ``None`` means (e.g. ``"the
        whole axis"``) and appears in the error message.
    """
    if value is None and optional is not None:
        return None
    none = f" or None ({optional})" if optional is not None else ""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int{none}, got {type(value).__name__} {value!r}")
    value = int(value)
    if choices is not None:
        allowed = sorted(set(choices))
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}{none}, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an int {_bounds(low, high)}{none}, got {value}")
    return value


def check_power_of_two(name: str, value: object, *, low: int = 1, optional: str | None = None) -> int | None:
    """A power-of-two int ``>= low`` (a Triton block size or chunk); ``optional`` as in :func:`check_int`."""
    value = check_int(name, value, low=low, optional=optional)
    if value is not None and value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {low}, got {value}")
    return value


def check_number(name: str, value: object, *, low: float | None = None, high: float | None = None) -> float:
    """A finite real number (any ``numbers.Real``: int, float, a NumPy scalar; not a bool) in ``[low, high]``;
    returned as float."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {_bounds(low, high)}, got {value}")
    return value


def check_integer_tensor(name: str, x: object, *, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """An integer tensor (int8..int64, uint8) of the given rank."""
    x = check_tensor(name, x, ndim=ndim)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    return x


def check_batch_index(name: str, index: object, batch: int | None) -> torch.Tensor:
    """``index`` as an int64 tensor of batch rows, each in ``[0, batch)`` (``batch`` None: any row >= 0): what
    ``Store.reorder`` and a cache's beam reordering take (rows may repeat or vanish). An integer tensor only -- a
    float index is refused, never truncated. One host read of the index's range.

    Raises
    ------
    TypeError
        ``index`` is not a one-dimensional integer tensor.
    ValueError
        A row outside ``[0, batch)``.
    """
    index = check_integer_tensor(name, index, ndim=1)
    if index.numel():
        lo, hi = torch.stack(torch.aminmax(index.long())).tolist()
        if lo < 0 or (batch is not None and hi >= batch):
            rows = f"[0, {batch})" if batch is not None else ">= 0"
            raise ValueError(f"{name} must hold batch rows in {rows}, got {index.tolist()}")
    return index.long()


MAX_POSITION = torch.iinfo(torch.int32).max
"""Largest true position a store holds (positions are stored as int32)."""


def check_positions(
    name: str,
    positions: object,
    shape: tuple[int, int],
    *,
    keep: torch.Tensor | None = None,
    after: torch.Tensor | None = None,
    values: bool = True,
) -> torch.Tensor:
    """True positions of the entries a ``Store`` receives, returned as int64.

    ``positions`` must be an int32/int64 tensor of ``shape`` ``(B, T)`` (one position per token of a batch row,
    shared by the KV heads). The positions of kept entries (``keep`` ``[B, H, T]``, default every entry) must be in
    ``[0, MAX_POSITION]`` and strictly increasing along ``T`` in every head (so a head's entries are identified and
    ordered by position), and when ``after`` ``[B]`` (the last position held per batch row, ``-1`` for none) is
    given, beyond it (appends come after what is held). Entries that are not kept (left padding, evicted tokens)
    may hold any position. With ``values=False`` only the dtype and shape are checked (nothing is read on the host).
    """
    positions = check_tensor(name, positions, ndim=2)
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {positions.dtype}")
    if tuple(positions.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape [B={shape[0]}, T={shape[1]}], got {tuple(positions.shape)}")
    B, T = shape
    p = positions.long()
    if not values:
        return p
    if keep is None:  # every entry kept (an append): one host read when the positions are valid
        first = torch.full((B, 1), -1, dtype=torch.long, device=p.device) if after is None else after
        prev = torch.cat([first.to(p.device).long().view(B, 1), p[:, :-1]], 1)
        if not bool(((p < 0) | (p > MAX_POSITION) | (p <= prev)).any()):
            return p
        keep = torch.ones(B, 1, T, dtype=torch.bool, device=p.device)  # invalid: the checks below say why
    keep = keep.to(p.device)
    H = keep.shape[1]
    ph = p[:, None, :].expand(B, H, T)
    if bool(((ph < 0) | (ph > MAX_POSITION))[keep].any()):
        raise ValueError(f"{name} of kept entries must be >= 0 and fit int32 (in [0, {MAX_POSITION}])")
    start = torch.full((B, H, 1), -1, dtype=torch.long, device=p.device)
    if after is not None:
        start = after.to(p.device).long()[:, None, None].expand(B, H, 1)
    prev = torch.cummax(torch.cat([start, torch.where(keep, ph, -1)], -1), -1).values[..., :-1]
    if bool((keep & (ph <= prev)).any()):
        where = " and come after every position held in their row" if after is not None else ""
        raise ValueError(
            f"{name} of kept entries must be distinct and strictly increasing per head{where} (true token positions)"
        )
    return p


_VALUE_CHECKS: ContextVar[bool | None] = ContextVar("kvcore_value_checks", default=None)


def values_checked(x: torch.Tensor) -> bool:
    """Whether the per-step value checks run for tensors on ``x``'s device (module doc): as set by
    :func:`value_checks`, else always on the CPU and with ``KVCORE_VALUE_CHECKS=1`` elsewhere."""
    forced = _VALUE_CHECKS.get()
    if forced is not None:
        return forced
    return x.device.type == "cpu" or os.environ.get("KVCORE_VALUE_CHECKS") == "1"


@contextmanager
def value_checks(enabled: bool = True) -> Iterator[None]:
    """Run (``True``) or skip (``False``) the per-step value checks on every device inside the block.

    Examples
    --------
    >>> import torch, kvcore
    >>> store = kvcore.DenseStore()
    >>> kv = torch.zeros(1, 1, 2, 4, device="cpu")
    >>> store.append(kv, kv, torch.tensor([[0, 1]]))
    >>> bad = torch.full((1, 1, 1, 4), float("nan"))
    >>> with kvcore.value_checks(False):  # what a CUDA tensor gets by default: NaN is stored, no host sync
    ...     store.append(bad, bad, torch.tensor([[2]]))
    >>> store.append(bad, bad, torch.tensor([[3]]))  # CPU tensors are always checked
    Traceback (most recent call last):
    ...
    ValueError: keys must be finite (found NaN or inf)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def check_append(
    keys: torch.Tensor, values: torch.Tensor, positions: object, after: torch.Tensor | None
) -> torch.Tensor:
    """The checks of ``Store.append(keys, values, positions)`` after :func:`check_kv`: positions of shape
    ``[B, n]`` (int32/int64) as int64 on the keys' device; where :func:`values_checked`, also finite keys and values
    and positions in range, strictly increasing and beyond ``after`` ``[B]`` (the last position held per row)."""
    B, _H, n, _D = keys.shape
    checked = values_checked(keys)
    positions = check_positions("positions", positions, (B, n), after=after, values=checked)
    if checked and keys.numel() and not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):
        check_finite("keys", keys)  # one read when both are finite; on failure, name the tensor
        check_finite("values", values)
    return positions.to(keys.device)
