"""The teacher pass of router training (SEKV §3.4): one forward of the frozen backbone with full KV, without grad.

It gives everything the step needs from the teacher, so the student runs only the continuation:

* the logits (surprisal of the prefix, Eq. 1, for the segmentation; the teacher distribution of Eq. 11);
* per layer, the post-RoPE keys of the whole sequence and the values of the prefix ``[0, c)``: the student's prefix
  is the teacher's (prefix queries attend exactly), so its keys and values are reused instead of recomputed;
* per layer, the teacher's continuation queries, from which the zoom targets of Eq. 12 are taken
  (:func:`zoom_targets`): the targets are the teacher's attention mass, independent of the router.

The recording attention function (``"sekv_teacher"``) is causal scaled-dot-product attention over unpadded rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TeacherRecord", "teacher_recording", "zoom_targets"]

NAME = "sekv_teacher"
_ACTIVE: list[TeacherRecord] = []


@dataclass
class TeacherRecord:
    """What the teacher pass records per layer (detached, float32).

    Parameters
    ----------
    split : int
        ``c``: the prefix ``[0, c)`` is compressed by the student.

    Attributes
    ----------
    keys : dict of int to Tensor
        ``[B, Hkv, T, D]`` post-RoPE keys of the whole sequence.
    values : dict of int to Tensor
        ``[B, Hkv, c, D]`` values of the prefix.
    queries : dict of int to Tensor
        ``[B, Hq, T − c, D]`` post-RoPE continuation queries.
    scale : float
        The attention scale of the backbone.
    """

    split: int
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    scale: float = 1.0

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys [L, B, Hkv, T, D], values [L, B, Hkv, c, D], queries [L, B, Hq, T − c, D])`` in layer order."""
        layers = sorted(self.keys)
        if layers != list(range(len(layers))):
            raise RuntimeError(f"the teacher pass recorded layers {layers}, expected 0 .. L-1")
        return tuple(torch.stack([d[i] for i in layers]) for d in (self.keys, self.values, self.queries))


def _attention(module: Any, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError("the sekv_teacher attention runs only inside kv_lab.sekv.teacher_recording(...)")
    rec = _ACTIVE[-1]
    c = rec.split
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = int(module.layer_idx)
    rec.keys[layer] = key.detach().float()
    rec.values[layer] = value[:, :, :c].detach().float()
    rec.queries[layer] = query[:, :, c:].detach().float()
    rec.scale = float(scale)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def teacher_recording(model: Any, record: TeacherRecord) -> Iterator[TeacherRecord]:
    """Run ``model`` with the recording ``"sekv_teacher"`` attention inside the block (restored afterwards)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _ACTIVE.append(record)
    try:
        yield record
    finally:
        _ACTIVE.pop()
        model.set_attn_implementation(before)


@torch.no_grad()
def zoom_targets(
    queries: torch.Tensor,
    keys: torch.Tensor,
    span_id: torch.Tensor,
    n_spans: int,
    scale: float,
    local_window: int,
    rho: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zoom targets (Eq. 12) and mined positions of one sequence, every layer at once.

    Parameters
    ----------
    queries : Tensor
        ``[L, Hq, Qc, D]`` the teacher's continuation queries (positions ``c .. c + Qc − 1``).
    keys : Tensor
        ``[L, Hkv, c + Qc, D]`` the teacher's keys.
    span_id : Tensor
        ``[c]`` the prefix segmentation (``−1`` resident).
    n_spans : int
        Number of spans.
    scale : float
        Attention scale.
    local_window : int
        A continuation query is mined when at least half of its head-mean teacher attention lies more than
        ``local_window`` tokens back (§3.4, "beyond a local window").
    rho : float
        Coverage: ``y_S = 1`` for the smallest set of spans holding ``ρ`` of the teacher's span mass.

    Returns
    -------
    (y, mined)
        ``y`` ``[L, Hq, Qc, n_spans]`` float 0/1 and ``mined`` ``[L, Qc]`` bool.
    """
    L, Hq, Qc, _ = queries.shape
    c = span_id.numel()
    kq = keys.float().repeat_interleave(Hq // keys.shape[1], 1)
    logits = queries.float() @ kq.transpose(-1, -2) * scale  # [L, Hq, Qc, T]
    qpos = torch.arange(c, c + Qc, device=queries.device)
    kpos = torch.arange(c + Qc, device=queries.device)
    logits = logits.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    full = torch.softmax(logits, -1)[..., :c]
    far = (kpos[None, :c] < (qpos[:, None] - local_window)).float()
    mined = (full * far).sum(-1).mean(1) >= 0.5
    in_span = (span_id >= 0).nonzero()[:, 0]
    a = torch.zeros(L, Hq, Qc, n_spans, device=queries.device).index_add_(-1, span_id[in_span], full[..., in_span])
    return coverage_targets(a, rho), mined


def coverage_targets(a: torch.Tensor, rho: float) -> torch.Tensor:
    """Eq. 12: ``y_S = 1`` for the smallest set of spans whose teacher mass reaches ``ρ`` of the span mass."""
    srt, idx = torch.sort(a, dim=-1, descending=True, stable=True)
    total = srt.sum(-1, keepdim=True)
    before = torch.cumsum(srt, -1) - srt
    take = before < rho * total  # include spans until the mass before them reaches ρ
    return torch.zeros_like(a).scatter(-1, idx, take.float())
