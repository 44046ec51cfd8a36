"""Training the SEKV router with the backbone frozen (SEKV §3.4, Eqs. 10–15): the straight-through SEKV attention
(:mod:`.forward`), the loss and loop (:mod:`.loop`), the data (:mod:`.data`) and the ``kv-sekv`` CLI
(:mod:`kv_sekv.cli`). Needs ``transformers`` for the backbone; ``kv-sekv[train]`` adds tqdm and matplotlib."""

from .data import corpus_sequences, split_sequences
from .forward import SEKVTraining, sekv_training
from .loop import TrainConfig, evaluate, train_router

__all__ = [
    "SEKVTraining",
    "TrainConfig",
    "corpus_sequences",
    "evaluate",
    "sekv_training",
    "split_sequences",
    "train_router",
]
