"""Reference stores."""

from kvcore.stores.dense import DenseStore

__all__ = ["DenseStore"]
