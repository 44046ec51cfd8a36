"""Decoding-stage HubKV (paper §4.3, Appendix A.1): periodic re-compression to a target length.

"For the decoding-stage experiment, the cache is repeatedly compressed during generation rather than
compressed only once after prefill. We [...] set the cache update interval to 128 decoding steps,
and evaluate fixed target KV lengths of 1024, 2048, 4096, and 6144. HubKV refines FastKVZip scores
before applying the same target-length pruning operation." (Appendix A.1)

:class:`DecodingSchedule` holds these parameters for the HuggingFace adapter's re-compression
hook (``integrations/kv-hf``; :meth:`DecodingSchedule.cache_options` gives its
``recompress_every`` / ``target_length`` options): every ``interval`` generated tokens, a layer whose
cache holds more than ``target_length`` entries is re-scored and pruned back to
``target_length`` with :meth:`DecodingSchedule.budget`. ``HubKV`` turns that token budget into
the gate ratio ``r = 1 - target_length / length`` (:class:`kv_hubkv.HubKV` notes).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore import Budget
from kvcore.checks import check_int

__all__ = ["DecodingSchedule"]


@dataclass(frozen=True, kw_only=True)
class DecodingSchedule:
    """When and to what length the decoding-stage cache is re-compressed.

    Parameters
    ----------
    interval : int, default 128
        Re-compress every ``interval`` generated tokens (paper: 128).
    target_length : int
        KV entries kept per head after each re-compression (paper: 1024, 2048, 4096, 6144).
    granularity : {"head", "layer", "global"}, default "head"
        Where the kept count is exact (``kvcore.Budget``).
    """

    interval: int = 128
    target_length: int
    granularity: str = "head"

    def __post_init__(self) -> None:
        for name in ("interval", "target_length"):
            v = getattr(self, name)
            check_int(name, v, low=1)
        Budget(tokens=self.target_length, granularity=self.granularity)  # validates granularity

    def due(self, generated: int) -> bool:
        """Whether the hook fires after ``generated`` decoded tokens (every ``interval``-th)."""
        check_int("generated", generated, low=0)
        return generated > 0 and generated % self.interval == 0

    def needs_compression(self, length: int) -> bool:
        """Whether a cache of ``length`` entries per head exceeds the target."""
        return length > self.target_length

    def ratio(self, length: int) -> float:
        """Gate ratio ``1 - target_length / length`` for a cache of ``length`` entries (0 if shorter)."""
        check_int("length", length, low=1)
        return max(0.0, 1.0 - self.target_length / length)

    def cache_options(self) -> dict[str, int]:
        """Keyword options for the HF adapter: ``kv_hf.compressed_cache(model, method, **opts)``."""
        return {"recompress_every": self.interval, "target_length": self.target_length}

    def budget(self) -> Budget:
        """The target-length budget for the re-compression step."""
        return Budget(tokens=self.target_length, granularity=self.granularity)
