"""Load a GGUF model once with transformers, cache it as a safetensors export, and load from the export after.

This is the machinery shared by the offline real models (:mod:`kvbench.models.smollm2`,
:mod:`kvbench.models.gemma3`): each knows where its GGUF file comes from and where its export lives;
this module reads a GGUF file (model and tokenizer, offline), builds the export when it is missing or
damaged, and loads model and tokenizer from it, rebuilding a cache found damaged on the way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.models.cache_dir import cache_root
from kvbench.models.export import (
    EXPORT_FORMAT,
    CorruptExportError,
    check_load_options,
    export_model,
    load_exported_model,
    load_exported_tokenizer,
    read_manifest,
    remove_export,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFSource:
    """Location of a packaged GGUF file.

    Parameters
    ----------
    path : Path
        Absolute path of the ``.gguf`` file.
    version : str
        Version of the distribution that ships it (``"unknown"`` without metadata).
    size : int
        File size in bytes.
    """

    path: Path
    version: str = "unknown"
    size: int = 0


def export_folder(model_id: str, version: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the export folder of one model at one package version.

    Parameters
    ----------
    model_id : str
        The model's sub-folder of the cache root.
    version : str
        Version of the package the GGUF comes from.
    cache_dir : str or PathLike, optional
        Cache root; :func:`~kvbench.models.cache_dir.default_cache_root` when omitted.

    Returns
    -------
    Path
        ``<root>/<model_id>/<version>-export<format>`` (a new layout format gets a new folder).
    """
    return cache_root(cache_dir) / model_id / f"{version}-export{EXPORT_FORMAT}"


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Set ``HF_HUB_OFFLINE=1`` for the duration of the block (restoring the previous value after)."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def read_gguf(path: str | os.PathLike, label: str = "GGUF") -> tuple[Any, Any]:
    """Load a causal LM (float32, dequantised) and its tokenizer from a GGUF file, offline.

    Parameters
    ----------
    path : str or PathLike
        The ``.gguf`` file.
    label : str
        Model name used in error messages.

    Returns
    -------
    model : transformers.PreTrainedModel
    tokenizer : transformers tokenizer

    Raises
    ------
    ModuleNotFoundError
        If ``gguf`` or ``accelerate`` (which transformers needs to read GGUF files) is missing.
    """
    for mod, why in (("gguf", "to read GGUF files"), ("accelerate", "by transformers to load GGUF files")):
        if importlib.util.find_spec(mod) is None:
            raise ModuleNotFoundError(
                f"the first {label} load needs the {mod!r} package ({why}); install it with `pip install {mod}`",
                name=mod,
            )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    folder, name = str(path.parent), path.name
    with hub_offline():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    return model, tokenizer


def ensure_export(
    path: str | os.PathLike,
    build: Callable[[], tuple[Any, Any]],
    *,
    label: str,
    source: Mapping[str, Any],
) -> Path:
    """Return a valid export folder at ``path``, building (or rebuilding) it with ``build`` when needed.

    Parameters
    ----------
    path : str or PathLike
        Export folder (per model and version).
    build : callable
        ``build() -> (model, tokenizer)``: the slow load (from the GGUF file), called only when the
        folder is missing or damaged.
    label : str
        Model name used in log lines and warnings.
    source : Mapping
        Provenance recorded in the export's manifest.

    Returns
    -------
    Path
        The export folder.
    """
    path = Path(path)
    try:
        read_manifest(path)
        return path
    except FileNotFoundError:
        pass
    except CorruptExportError as e:
        warnings.warn(f"{label} cache at {str(path)!r} is damaged ({e}); rebuilding it", RuntimeWarning, stacklevel=3)
        remove_export(path)
    logger.info("building the %s cache at %s (one-time)", label, path)
    model, tokenizer = build()
    export_model(model, path, tokenizer, dtype=torch.bfloat16, source=source)
    del model
    read_manifest(path)
    return path


def load_cached(
    ensure: Callable[[], Path],
    *,
    label: str,
    dtype: torch.dtype,
    device: str | torch.device,
    attn_implementation: str,
) -> tuple[Any, Any]:
    """Load model and tokenizer from the export ``ensure()`` returns, rebuilding it once if it will not load.

    Parameters
    ----------
    ensure : callable
        ``ensure() -> Path``: a valid export folder (built when missing, see :func:`ensure_export`).
    label : str
        Model name used in warnings.
    dtype : torch.dtype
        Parameter dtype.
    device : str or torch.device
        Device to place the model on.
    attn_implementation : str
        ``"sdpa"``, ``"eager"``, or any name registered with ``AttentionInterface``.

    Returns
    -------
    model : transformers.PreTrainedModel
        In eval mode.
    tokenizer : transformers tokenizer

    Raises
    ------
    TypeError
        For a ``dtype`` that is not a floating torch dtype or an ``attn_implementation`` that is not a str
        (before any export is built).
    """
    check_load_options(dtype, attn_implementation)
    path = ensure()
    try:
        model = load_exported_model(path, dtype=dtype, device=device, attn_implementation=attn_implementation)
        tokenizer = load_exported_tokenizer(path)
    except CorruptExportError as e:
        warnings.warn(
            f"{label} cache at {str(path)!r} could not be loaded ({e}); rebuilding it", RuntimeWarning, stacklevel=3
        )
        remove_export(path)
        path = ensure()
        model = load_exported_model(path, dtype=dtype, device=device, attn_implementation=attn_implementation)
        tokenizer = load_exported_tokenizer(path)
    return model, tokenizer


def cached_loader(
    ensure: Callable[[str | os.PathLike | None], Path], *, label: str, name: str, doc: str
) -> Callable[..., tuple[Any, Any]]:
    """Make a model's public loader: ``loader(dtype, device, cache_dir, attn_implementation) -> (model, tokenizer)``.

    Every offline model has the same loader (the call ``kvbench --model`` makes); only how its export is
    found or built differs.

    Parameters
    ----------
    ensure : callable
        ``ensure(cache_dir) -> Path``: the model's valid export folder under the cache root ``cache_dir``
        (``None``: the default root), built when missing.
    label : str
        Model name used in warnings.
    name : str
        The loader's ``__name__``.
    doc : str
        The loader's docstring (parameters, the returned model class, what a first load does).

    Returns
    -------
    callable
        ``loader(dtype=torch.float32, device="cpu", cache_dir=None, attn_implementation="sdpa")``, which
        calls :func:`load_cached`.
    """

    def loader(
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        cache_dir: str | os.PathLike | None = None,
        attn_implementation: str = "sdpa",
    ) -> tuple[Any, Any]:
        return load_cached(
            lambda: ensure(cache_dir),
            label=label,
            dtype=dtype,
            device=device,
            attn_implementation=attn_implementation,
        )

    loader.__name__ = loader.__qualname__ = name
    loader.__doc__ = doc
    return loader


def load_cached_tokenizer(ensure: Callable[[], Path]) -> Any:
    """Load the tokenizer from the export ``ensure()`` returns, rebuilding the export once if it is damaged.

    Parameters
    ----------
    ensure : callable
        ``ensure() -> Path``, as in :func:`load_cached`.

    Returns
    -------
    transformers tokenizer
    """
    path = ensure()
    try:
        return load_exported_tokenizer(path)
    except CorruptExportError:
        remove_export(path)
        return load_exported_tokenizer(ensure())
