"""FastKVzip gate training (Kim et al. 2026a): regress a per-layer sink-attention gate on KVzip's scores."""

from kv_lab.fastkvzip.train import collect, evaluate, train

__all__ = ["collect", "evaluate", "train"]
