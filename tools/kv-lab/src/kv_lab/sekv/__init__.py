"""Training the SEKV router with the backbone frozen (SEKV §3.4, Eqs. 10–15): the straight-through SEKV attention
(:mod:`.forward`) fed by one teacher pass (:mod:`.teacher`), the loss and loop (:mod:`.loop`), the data
(:mod:`.data`) and the ``kv-sekv`` CLI (:mod:`kv_lab.sekv.cli`). The router it trains is ``kv_sekv.SEKVRouter``
(the runtime method, which loads the written artifact); transformers, tqdm and matplotlib are kv-lab's
dependencies."""

from .data import corpus_sequences, split_sequences
from .forward import SEKVTraining, SpanRow, prepare_training, sekv_training
from .loop import TrainConfig, evaluate, train_router
from .teacher import TeacherRecord, teacher_recording, zoom_targets

__all__ = [
    "SEKVTraining",
    "SpanRow",
    "TeacherRecord",
    "TrainConfig",
    "corpus_sequences",
    "evaluate",
    "prepare_training",
    "sekv_training",
    "split_sequences",
    "teacher_recording",
    "train_router",
    "zoom_targets",
]
