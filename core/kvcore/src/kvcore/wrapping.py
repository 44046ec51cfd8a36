"""``WrappingScorer``: a Scorer computed over another one's scores, reading what that one reads.

Score refinements (HubKV's hub discount, ChunkKV's chunk means) wrap a base scorer (docs/architecture.md: wrappers
are Scorers). What an adapter must supply is then the base's: its queries, query window, values and extras. This
class declares exactly that, so a wrapper states only what it adds.
"""

from __future__ import annotations

from kvcore.protocols import Scorer

__all__ = ["WrappingScorer"]


class WrappingScorer(Scorer):
    """Base class of scorers over ``self.base`` (a :class:`kvcore.Scorer`): ``needs_queries``, ``query_window``,
    ``needs_values`` and ``needs_extras`` are the base's. ``chunkable`` stays ``False`` unless the subclass declares
    otherwise (a refinement over the whole prompt is not a per-chunk score). Subclasses provide ``base`` (a
    dataclass field, say) and check it with :meth:`check_base`."""

    base: Scorer

    def check_base(self) -> None:
        """``TypeError`` unless ``self.base`` implements :class:`kvcore.Scorer`."""
        if not isinstance(self.base, Scorer):
            raise TypeError(f"base must implement kvcore.Scorer, got {type(self.base).__name__}")

    @property
    def needs_queries(self) -> bool:
        return bool(self.base.needs_queries)

    @property
    def needs_values(self) -> bool:
        return bool(self.base.needs_values)

    @property
    def needs_extras(self) -> frozenset[str]:
        return frozenset(self.base.needs_extras)

    @property
    def query_window(self) -> int | None:
        return self.base.query_window
