"""The model ``kvbench tune --model`` names: a registered offline model, a local transformers folder or a GGUF file.

Each is checked *before* any weights are read, with the rules of the transformers adapter
(:func:`kv_hf.support.check_config`): a folder's ``config.json`` is read with transformers' ``AutoConfig`` and checked
whole; a GGUF file's architecture and attention shape are read from its header (:func:`gguf_header`, a few
kilobytes; the tokenizer arrays are skipped), so a family kv_hf does not serve is refused at once. Loading is
offline (``HF_HUB_OFFLINE=1``, ``local_files_only``): nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvbench.models.registry import MODELS, get_model

__all__ = ["ModelSource", "gguf_header", "resolve_model"]

GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}
"""GGUF ``general.architecture`` names that transformers loads as another ``model_type`` (as its GGUF loader does);
the others are the same name."""


@dataclass(frozen=True)
class ModelSource:
    """Where ``--model`` points and what is known of it before loading.

    Attributes
    ----------
    kind : {"registered", "folder", "gguf"}
        A :data:`kvbench.models.MODELS` name, a transformers folder or a ``.gguf`` file.
    name : str
        The registry name, or the path as given.
    title : str
        Model name recorded in results.
    fingerprint : str
        What the cell cache keys on: the registry title, or the path's name with the sizes and modification times
        of its files (a changed checkpoint recomputes its cells).
    fp16_bytes_per_token : int or None
        Bytes per token of an uncompressed fp16 K+V cache, when the header or config gives it before loading.
    """

    kind: str
    name: str
    title: str
    fingerprint: str
    fp16_bytes_per_token: int | None = None

    def load(self, dtype: Any, device: str) -> tuple[Any, Any]:
        """Load ``(model, tokenizer)`` offline, the model in eval mode on ``device`` with the SDPA kernel.

        Raises
        ------
        ValueError
            A model kv_hf refuses once loaded (:func:`kv_hf.check_model`: what the header could not tell).
        """
        from kv_hf import check_model

        if self.kind == "registered":
            model, tok = get_model(self.name).load(dtype=dtype, device=device)
        elif self.kind == "folder":
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from kvbench.models.gguf_export import hub_offline

            with hub_offline():
                tok = AutoTokenizer.from_pretrained(self.name, local_files_only=True)
                model = AutoModelForCausalLM.from_pretrained(
                    self.name, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
                )
            model = model.to(device).eval()
        else:
            from kvbench.models.gguf_export import read_gguf

            model, tok = read_gguf(self.name, label=Path(self.name).name)
            model = model.to(device=device, dtype=dtype).eval()
        check_model(model)
        return model, tok


def _stamp(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def fp16_bytes(layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes per token of an uncompressed fp16 K+V cache (the yardstick of :func:`kvbench.run.fp16_bytes_per_token`)."""
    return 2 * layers * kv_heads * head_dim * 2


def resolve_model(text: str) -> ModelSource:
    """Turn ``--model`` into a :class:`ModelSource`, refusing what kv_hf cannot serve before any weights are read.

    Parameters
    ----------
    text : str
        A registered model name (``kvbench --list-models``), a folder holding a transformers ``config.json``, or a
        ``.gguf`` file.

    Raises
    ------
    ValueError
        Naming ``--model``: not a registered name nor an existing folder / GGUF file, a folder without
        ``config.json``, a file that is not GGUF, or a model kv_hf refuses (its family or layer types).
    """
    if text in MODELS:
        entry = get_model(text)
        return ModelSource("registered", text, entry.title, entry.title)
    path = Path(text).expanduser()
    if path.is_dir():
        return _folder(text, path)
    if path.is_file():
        return _gguf(text, path)
    raise ValueError(
        f"--model: {text!r} is neither a registered model ({', '.join(MODELS)}) nor a local transformers folder or "
        ".gguf file"
    )


def _refused(text: str, exc: Exception) -> ValueError:
    return ValueError(f"--model {text}: the transformers adapter refuses this model: {exc}")


def _folder(text: str, path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: folder {text!r} has no config.json (a transformers model folder has one)")
    from transformers import AutoConfig

    from kv_hf.support import check_config
    from kvbench.models.gguf_export import hub_offline

    try:
        with hub_offline():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--model: {text!r}: transformers cannot read its config.json ({exc})") from None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        check_config(config)
    except ValueError as exc:
        raise _refused(text, exc) from None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    files = [p for p in path.iterdir() if p.is_file()]
    return ModelSource(
        "folder",
        text,
        path.resolve().name,
        f"{path.resolve().name}-{_stamp(files)}",
        fp16_bytes(config.num_hidden_layers, kv_heads, head_dim),
    )


def _gguf(text: str, path: Path) -> ModelSource:
    from kv_hf.support import SUPPORTED_MODEL_TYPES

    try:
        with path.open("rb") as f:
            header = gguf_header(f)
    except ValueError as exc:
        raise ValueError(f"--model: {text!r} is not a GGUF file ({exc}); give a .gguf file or a model folder") from None
    arch = header.get("general.architecture")
    model_type = GGUF_ARCHITECTURES.get(arch, arch)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = sorted(SUPPORTED_MODEL_TYPES)
        raise _refused(text, ValueError(f"kv_hf supports the model types {supported}, got {arch!r}"))
    layers = header.get(f"{arch}.block_count")
    heads = header.get(f"{arch}.attention.head_count")
    kv_heads = header.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = header.get(f"{arch}.attention.key_length")
    if head_dim is None and heads and header.get(f"{arch}.embedding_length"):
        head_dim = header[f"{arch}.embedding_length"] // heads
    bpt = fp16_bytes(layers, kv_heads, head_dim) if layers and kv_heads and head_dim else None
    return ModelSource("gguf", text, path.name, f"{path.name}-{_stamp([path])}", bpt)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated header")
    return data


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8))
        return _read(f, n).decode("utf-8", "replace") if keep else f.seek(n, 1)
    if kind == _ARRAY:
        item, n = struct.unpack("<IQ", _read(f, 12))
        if item in _SCALARS:  # fixed width: skip in one seek
            f.seek(n * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(n):
                _value(f, item, False)
        return None
    raise ValueError(f"unknown metadata value type {kind}")


def gguf_header(f: BinaryIO) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (arrays such as the tokenizer's vocabulary are skipped).

    Parameters
    ----------
    f : binary file
        Open at the start of the file.

    Returns
    -------
    dict
        Metadata key -> value (``"general.architecture"``, ``"llama.block_count"``, ...).

    Raises
    ------
    ValueError
        When the file does not start with the GGUF magic or its header is truncated or malformed.
    """
    if f.read(4) != b"GGUF":
        raise ValueError("no GGUF magic")
    version, _tensors, count = struct.unpack("<IQQ", _read(f, 20))
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    out: dict[str, Any] = {}
    for _ in range(count):
        (n,) = struct.unpack("<Q", _read(f, 8))
        key = _read(f, n).decode("utf-8", "replace")
        (kind,) = struct.unpack("<I", _read(f, 4))
        value = _value(f, kind, True)
        if value is not None and kind != _ARRAY:
            out[key] = value
    return out
