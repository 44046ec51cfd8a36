"""Export a loaded causal LM to a compact safetensors folder and load it back.

The export is what :func:`kvbench.models.load_smollm2` caches after the (slow) first GGUF load, but
the machinery works for any ``transformers`` causal LM, which is how it is tested (a tiny random
Llama). An export folder holds

* ``model.safetensors``: the state dict in the export dtype (bf16 by default), **without** tensors
  that share storage with an earlier one (the tied ``lm_head.weight``);
* ``config.json`` (and ``generation_config.json``): the model config with any quantization config
  (GGUF) removed, so the folder loads as a plain, unquantized model;
* tokenizer files, when a tokenizer is given;
* ``kvcompress_export.json``: the manifest (format version, file sizes, tied keys, provenance),
  written last.

Folders are written atomically: everything goes to a hidden temporary sibling that is renamed into
place at the end, so a crash never leaves a half-written export under the final name.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

#: Version of the on-disk layout; bump it when the layout changes (old caches are then rebuilt).
EXPORT_FORMAT = 1
#: Manifest file name inside an export folder.
MANIFEST_NAME = "kvcompress_export.json"
#: Weights file name inside an export folder.
WEIGHTS_NAME = "model.safetensors"


class CorruptExportError(RuntimeError):
    """An export folder exists but is incomplete, damaged or of another format version."""


def _shared_storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def export_state_dict(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Return the state dict to save, with storage-sharing (tied) tensors removed.

    Parameters
    ----------
    model : torch.nn.Module
        The model to export.
    dtype : torch.dtype
        Floating-point dtype of the saved tensors; non-float tensors (buffers) keep theirs.

    Returns
    -------
    tensors : dict[str, Tensor]
        Contiguous CPU tensors keyed by state-dict name, the first of each tied group only.
    tied : dict[str, str]
        ``{dropped_name: kept_name}`` for every tensor that shared storage with a kept one.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict().items():
        key = _shared_storage_key(t)
        if key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        t = t.detach()
        if t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.to("cpu").contiguous()
    return tensors, tied


def _plain_config(model: Any, dtype: torch.dtype) -> Any:
    cfg = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            try:
                delattr(cfg, attr)
            except AttributeError:  # pragma: no cover - class-level attribute
                setattr(cfg, attr, None)
    cfg.dtype = dtype
    return cfg


def export_model(
    model: Any,
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    source: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (and optionally ``tokenizer``) to an export folder, atomically.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded causal LM (may come from a GGUF file; its quantization config is dropped).
    path : str or PathLike
        Final folder. Its parent is created if needed.
    tokenizer : transformers tokenizer, optional
        Saved alongside with ``save_pretrained`` when given.
    dtype : torch.dtype
        Dtype of the saved floating tensors (default bf16).
    source : Mapping, optional
        JSON-serialisable provenance recorded in the manifest (e.g. package name and version).
    overwrite : bool
        Replace an existing folder at ``path``. Without it an existing folder raises
        ``FileExistsError``; if another process finishes the same export first, its folder is kept.

    Returns
    -------
    Path
        The export folder.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"path {str(path)!r} already exists (pass overwrite=True to replace it)")
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors, tied = export_state_dict(model, dtype)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        _plain_config(model, dtype).save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        import transformers

        manifest = {
            "format": EXPORT_FORMAT,
            "model_class": type(model).__name__,
            "dtype": str(dtype).removeprefix("torch."),
            "num_tensors": len(tensors),
            "tied": tied,
            "has_tokenizer": tokenizer is not None,
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
            "source": dict(source or {}),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }
        with open(tmp / MANIFEST_NAME, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if path.exists() and overwrite:
            remove_export(path)
        try:
            os.replace(tmp, path)
        except OSError:
            if path.exists() and not overwrite:  # lost a race with a concurrent writer: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
                return path
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def remove_export(path: str | os.PathLike) -> None:
    """Delete an export folder (first renamed aside, so readers never see it half-deleted).

    Parameters
    ----------
    path : str or PathLike
        The folder to remove; a missing folder is not an error.
    """
    path = Path(path)
    if not path.exists():
        return
    trash = path.parent / f".{path.name}.trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Check an export folder and return its manifest.

    Checks that the manifest exists, has the current format version, that every file it lists
    has the recorded size, and that the safetensors header is readable with the recorded number
    of tensors.

    Parameters
    ----------
    path : str or PathLike
        Export folder.

    Returns
    -------
    dict
        The manifest.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    CorruptExportError
        If the folder is incomplete, damaged or of another format version.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no export folder at {str(path)!r}")
    mpath = path / MANIFEST_NAME
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CorruptExportError(f"export folder {str(path)!r} has no {MANIFEST_NAME} (incomplete write)") from None
    except (OSError, ValueError) as e:
        raise CorruptExportError(f"export manifest {str(mpath)!r} is unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise CorruptExportError(f"export folder {str(path)!r} has format {got!r}, expected {EXPORT_FORMAT}")
    for name, size in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CorruptExportError(f"export folder {str(path)!r} lacks {name!r}")
        if f.stat().st_size != size:
            raise CorruptExportError(f"{str(f)!r} has {f.stat().st_size} bytes, the manifest says {size}")
    if WEIGHTS_NAME not in manifest.get("files", {}):
        raise CorruptExportError(f"export manifest of {str(path)!r} lists no {WEIGHTS_NAME}")
    from safetensors import safe_open

    try:
        with safe_open(str(path / WEIGHTS_NAME), framework="pt") as sf:
            n = len(list(sf.keys()))
    except Exception as e:  # safetensors raises its own error type for damaged headers
        raise CorruptExportError(f"{str(path / WEIGHTS_NAME)!r} is unreadable: {e}") from e
    if n != manifest.get("num_tensors"):
        raise CorruptExportError(
            f"{str(path / WEIGHTS_NAME)!r} holds {n} tensors, the manifest says {manifest.get('num_tensors')}"
        )
    return manifest


def check_load_options(dtype: Any, attn_implementation: Any) -> None:
    """Check the options of a model load before any slow work.

    Parameters
    ----------
    dtype : torch.dtype
        Must be a floating-point dtype.
    attn_implementation : str
        Must be a string.

    Raises
    ------
    TypeError
        Naming the option and what it takes.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str, got {type(attn_implementation).__name__}")


def load_exported_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> Any:
    """Load a model from an export folder written by :func:`export_model`.

    Parameters
    ----------
    path : str or PathLike
        Export folder.
    dtype : torch.dtype
        Dtype of the loaded parameters (the bf16 export is upcast for float32).
    device : str or torch.device
        Device to move the model to.
    attn_implementation : str
        Passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, or a registered attention function).

    Returns
    -------
    transformers.PreTrainedModel
        The model, in eval mode, with tied weights restored.

    Raises
    ------
    FileNotFoundError
        If there is no folder at ``path``.
    CorruptExportError
        If the folder is damaged (see :func:`read_manifest`) or the weights do not cover the model.
    """
    check_load_options(dtype, attn_implementation)
    path = Path(path)
    manifest = read_manifest(path)
    import transformers

    cls = getattr(transformers, manifest.get("model_class", ""), None) or transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(
        str(path),
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
        output_loading_info=True,
    )
    tied = manifest.get("tied", {})
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    if missing:
        raise CorruptExportError(f"export {str(path)!r} lacks weights for {missing[:5]}")
    params = dict(model.named_parameters(remove_duplicate=False))
    for dropped, kept in tied.items():
        if dropped in params and kept in params and params[dropped] is not params[kept]:
            model.tie_weights()
            params = dict(model.named_parameters(remove_duplicate=False))
            if params[dropped] is not params[kept]:
                raise CorruptExportError(f"could not restore the tie {dropped!r} -> {kept!r} in {str(path)!r}")
    model = model.to(device)
    model.eval()
    return model


def load_exported_tokenizer(path: str | os.PathLike) -> Any:
    """Load the tokenizer saved in an export folder.

    Parameters
    ----------
    path : str or PathLike
        Export folder written with a tokenizer.

    Returns
    -------
    transformers tokenizer

    Raises
    ------
    CorruptExportError
        If the folder is damaged or was written without a tokenizer.
    """
    manifest = read_manifest(path)
    if not manifest.get("has_tokenizer"):
        raise CorruptExportError(f"export folder {str(path)!r} was written without a tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
