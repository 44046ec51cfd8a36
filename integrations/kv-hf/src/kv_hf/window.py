"""The sliding-window layers of a hybrid model (Gemma 2/3, gpt-oss, ...) inside a kv_hf cache.

A model whose layers mix sliding-window and global attention keeps, in each sliding layer, only the last
``sliding_window - 1`` tokens: that window is already bounded, so kv_hf leaves it as transformers keeps it
(:class:`transformers.cache_utils.DynamicSlidingWindowLayer`, bit for bit) and compresses the global layers only.
:class:`WindowLayer` adds what the kv_hf cache asks of every layer besides transformers' own calls:

* the ``scratch`` mode of KVzip's reconstruction pass (forward passes that attend to the cache and leave nothing:
  the window returns ``[window | new]`` and keeps neither the new tokens nor their count);
* rollback to an earlier length (:meth:`truncate`, the multi-question protocol's crop back to the context) while a
  :meth:`hold` is open: the tokens that slide out of the window meanwhile are kept aside until it closes, since
  transformers' own layer cannot crop once its window is full;
* its bytes (:meth:`nbytes`), counted in the cache's total (the storage held: after a prefill the window is copied
  out of the prompt-long tensor transformers slices it from, so the prompt's keys and values are freed at once).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kv_hf.step import SCRATCH, STORE
from kvcore import storage_bytes


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer as transformers keeps it, with kv_hf's scratch mode, rollback and byte count.

    Parameters
    ----------
    layer_idx : int
        Index of the attention layer.
    sliding_window : int
        The model's window (``config.sliding_window``): the layer keeps the last ``sliding_window - 1`` tokens.
    """

    def __init__(self, layer_idx: int, sliding_window: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.layer_idx = layer_idx
        self.mode = STORE
        self._dropped: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # set while a hold is open

    def __repr__(self) -> str:
        return f"WindowLayer(layer_idx={self.layer_idx}, window={self.sliding_window}, seen={self.cumulative_length})"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.mode == SCRATCH:  # attend to [window | new], keep nothing
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        if self._dropped is None:
            full_k, full_v = super().update(key_states, value_states, *args, **kwargs)
            self._own_storage()
            return full_k, full_v
        full_k = torch.cat([self.keys, key_states], dim=-2)
        full_v = torch.cat([self.values, value_states], dim=-2)
        keep = self.sliding_window - 1
        if full_k.shape[-2] > keep:  # what slides out now, kept until the hold closes
            self._dropped.append((full_k[:, :, :-keep], full_v[:, :, :-keep]))
        self.cumulative_length += key_states.shape[-2]
        self.keys, self.values = full_k[:, :, -keep:], full_v[:, :, -keep:]
        return full_k, full_v

    def _own_storage(self) -> None:
        """Copy the window out of the prefill's tensor it is a view of: transformers' layer keeps the last
        ``sliding_window - 1`` tokens as a slice of ``[past | new]``, so after a long prefill the whole prompt's keys
        and values stay allocated until the next update. A window that holds under half its storage is copied (the
        same values), which frees the rest; a decode step's slice (one token over the window) is left as it is."""
        if self.keys.untyped_storage().nbytes() > 2 * self.keys.numel() * self.keys.element_size():
            self.keys, self.values = self.keys.clone(), self.values.clone()

    def hold(self) -> None:
        """Start keeping what slides out of the window, so that :meth:`truncate` can go back to the current length."""
        self._dropped = []

    def release(self) -> None:
        """Stop keeping it (and free it)."""
        self._dropped = None

    def truncate(self, length: int) -> None:
        """Forget every token slot from ``length`` on (nothing when ``length`` is not below the tokens seen).

        Raises ``RuntimeError`` when the window no longer holds the tokens before ``length`` (the window slid past
        them and no :meth:`hold` was open since).
        """
        remove = self.cumulative_length - length
        if remove <= 0 or not self.is_initialized:
            return
        parts = [*(self._dropped or []), (self.keys, self.values)]
        keys = torch.cat([k for k, _ in parts], dim=-2)
        values = torch.cat([v for _, v in parts], dim=-2)
        visible = keys.shape[-2]  # the last `visible` token slots are available
        want = min(length, self.sliding_window - 1)  # slots the window must hold after truncating
        if visible - remove < want:
            raise RuntimeError(
                f"layer {self.layer_idx}: cannot roll the sliding window back to {length} tokens (it no longer holds "
                f"them; open a hold() before the tokens to forget are added)"
            )
        self.keys = keys[:, :, visible - remove - want : visible - remove]
        self.values = values[:, :, visible - remove - want : visible - remove]
        self.cumulative_length = length
        if self._dropped is not None:
            self._dropped = []

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of the window's keys and values (on ``device`` only, when given)."""
        return storage_bytes((self.keys, self.values), device) if self.is_initialized else 0

    def resident_nbytes(self) -> int:
        """The window lives where the model runs: all of it is resident."""
        return self.nbytes()
