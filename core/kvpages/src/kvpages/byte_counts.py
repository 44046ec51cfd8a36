"""What a codec saved: the ratio and difference of fp16 bytes to stored bytes, for any metrics record."""

from __future__ import annotations

__all__ = ["ByteCounts"]


class ByteCounts:
    """Mixin of a metrics record with ``stored_bytes`` (blob bytes written) and ``fp16_bytes`` (the same pages in
    fp16) fields: :class:`kvpages.CacheMetrics` and the engine adapters' own records report the same two figures the
    same way."""

    stored_bytes: int
    fp16_bytes: int

    @property
    def compression(self) -> float:
        """fp16 bytes per stored byte over everything saved (0 before the first save)."""
        return self.fp16_bytes / self.stored_bytes if self.stored_bytes else 0.0

    @property
    def saved_bytes(self) -> int:
        """Bytes compression saved: fp16 bytes of what was stored minus the bytes stored (negative if lossless)."""
        return self.fp16_bytes - self.stored_bytes

    def byte_summary(self) -> dict[str, float]:
        """``{"compression": ..., "saved_bytes": ...}``, to merge into a record's ``as_dict``."""
        return {"compression": self.compression, "saved_bytes": self.saved_bytes}
