"""The attention function kv_hf registers with transformers.

Why a registered attention function and not a forward hook: attention over a compressed layer must add the
per-entry ``KVView.logit_bias`` (``-inf`` for the padding of ragged per-head layouts, ``log|S|`` for span
summaries), and the scorers need the post-RoPE query states. The function registered here sees both the query
and the key/value tensors the cache layer returned, so it can build the per-layer, per-head mask, run the usual
kernel and hand the query back to the layer (query capture, KVzip scoring) in one place. kvpress instead patches
the kernels in place and only *masks* evicted keys; here the evicted keys are gone.

Two names are registered: ``"kv_hf"`` runs transformers' SDPA kernel, ``"kv_hf_eager"`` the model's eager
attention. Both delegate unchanged for any cache that is not a kv_hf cache, so switching a model to them does not
change its behaviour elsewhere. Flash-attention and flex kernels cannot take an additive per-head bias and are
refused (:func:`enable_attention`).

How a step flows: ``CompressedLayer.update`` returns ``[stored view | pending raw | new]`` key/value tensors and
hands its :class:`~kv_hf.step.Step` over explicitly (:func:`kv_hf.step.hand_off`; nothing is set on the tensor);
the function below takes it with the key tensor it received (:func:`kv_hf.step.take_step`), builds the mask
(stored and pending columns from the layer's bias, the new columns from the last ``q`` columns of the mask
transformers built), runs the kernel and calls ``Step.layer.commit`` (then the cache's ``Step.on_commit`` hook,
carried from the layer's ``on_commit``, which compresses a finished prefill or re-compresses).

Stores that declare ``can_attend`` are not read back at all: the layer returns only the step's new K/V, and the
function attends to the Store with its fused ``attend(query, scale) -> (out, lse)``, to ``[pending | new]`` with an
lse-returning reference (causal among the new tokens, padding masked), and combines the two with
``kvcore.merge_attention`` (the online-softmax identity of FlashAttention, Dao et al. 2022, §3.1). A single real
new token with nothing pending (plain decode) is appended to the Store first and attended with one ``attend`` call
(:func:`decode_step`), which needs no separate attention over the new token and no merge. Over a Store without
``attend`` such a token is also appended first and the kernel runs over ``read()`` (:func:`read_step`), so the
cache is not concatenated with the new token every step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from kv_hf.implementations import KV_HF_EAGER, KV_HF_IMPLEMENTATIONS, KV_HF_SDPA
from kv_hf.step import Step, take_step
from kv_hf.step_memo import STEP
from kvcore import merge_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel


_WRAPS = {"sdpa": KV_HF_SDPA, "eager": KV_HF_EAGER}
_UNWRAPS = {v: k for k, v in _WRAPS.items()}


# -- base kernels ------------------------------------------------------------------------------------------
def _generic_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention as in transformers' Llama (used when the model module has no ``eager_attention_forward``)."""
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    w = torch.nn.functional.dropout(w, p=dropout, training=module.training)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def _eager(module, query, key, value, attention_mask, **kwargs):
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) or _generic_eager
    return fn(module, query, key, value, attention_mask, **kwargs)


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# -- masks -------------------------------------------------------------------------------------------------
def _new_token_mask(attention_mask: torch.Tensor | None, q: int) -> torch.Tensor | None:
    """Boolean ``[B|1, 1|H, q, q]`` mask of the step's own tokens (last ``q`` columns), or ``None`` = no padding."""
    if attention_mask is None:
        return None
    m = attention_mask[..., -q:]
    if m.dtype != torch.bool:  # an additive float mask: 0 = attend
        m = m > torch.finfo(m.dtype).min / 2
    return m


def _causal(q: int, device: torch.device) -> torch.Tensor:
    return torch.ones(q, q, dtype=torch.bool, device=device).tril()[None, None]


def _as_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def step_mask(
    step: Step, attention_mask: torch.Tensor | None, query: torch.Tensor, eager: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The mask for one kv_hf step and the boolean new-token mask (``None`` = plain causal, no padding).

    Returns the mask to hand to the kernel: unchanged where the step has no stored/pending prefix (the exact call
    an unmodified model makes, hence bitwise-equal logits), ``None`` for a single query
    over an unbiased prefix (decode without padding, again the unmodified call), otherwise an additive float mask
    ``[B, 1|Hq, q, prefix + q]``: the prefix columns carry the layer's per-head bias (``-inf`` clamped to the
    dtype's minimum, as transformers does), the new columns the causal/padding pattern.
    """
    B, Hq, q, _ = query.shape
    dtype, device = query.dtype, query.device
    new = _new_token_mask(attention_mask, q)
    if step.n_prefix == 0:
        if attention_mask is None or attention_mask.shape[-1] == q:
            return attention_mask, new
        m = new  # transformers sized the mask for another layer's prefix: keep its new-token columns
        return (_as_float(m, dtype) if eager else m), new
    if step.bias is None and new is None and q == 1:
        return None, None
    m_new = (
        new
        if new is not None
        else (_causal(q, device) if q > 1 else torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device))
    )
    heads = 1
    if step.bias is None:
        prefix = torch.zeros(B, 1, 1, step.n_prefix, dtype=dtype, device=device)
    else:
        bias = step.bias
        if not bool((bias == bias[:, :1]).all()):
            bias = bias.repeat_interleave(Hq // bias.shape[1], dim=1)
            heads = Hq
        else:
            bias = bias[:, :1]
        prefix = bias.to(dtype).clamp_min(torch.finfo(dtype).min)[:, :, None, :]
    heads = max(heads, m_new.shape[1])
    prefix = prefix.expand(B, heads, q, step.n_prefix)
    new_part = _as_float(m_new, dtype).expand(B, heads, q, q)
    return torch.cat([prefix, new_part], dim=-1), new


def masked_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q·kᵀ·scale + bias)·v`` in float32 with its log-sum-exp, GQA-aware.

    ``query`` ``[B, Hq, q, D]``, ``keys``/``values`` ``[B, Hkv, N, D]``, ``bias`` ``[B|1, 1|Hq, q, N]`` additive float
    (``-inf`` = masked). Returns ``out`` ``[B, Hq, q, D]`` and ``lse`` ``[B, Hq, q]`` (``-inf``, ``out = 0`` for a
    row that sees nothing), as :func:`kvcore.reference_attention` does over a view.
    """
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    logits = query.float() @ k.transpose(-1, -2) * scale + bias.float()
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    return torch.exp(logits - safe[..., None]) @ v, lse


def fused_step(step: Step, query: torch.Tensor, new: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` over ``[Store | pending | new]`` through the Store's fused ``attend``.

    Returns the attention output laid out as transformers' kernels return it, ``[B, q, Hq, D]`` in the query dtype.
    """
    layer = step.layer
    B, _, q, _ = query.shape
    device = query.device
    out_s, lse_s = layer.store.attend(query, scaling)
    m_new = new if new is not None else torch.ones(q, q, dtype=torch.bool, device=device).tril()[None, None]
    new_bias = torch.where(m_new.to(device), 0.0, float("-inf")).expand(B, -1, q, q)
    keys, values, biases = step.keys, step.values, [new_bias]
    part = layer.pending_part(step.keys.dtype)
    if part is not None:
        keys, values = torch.cat([part[0], keys], 2), torch.cat([part[1], values], 2)
        pending_bias = part[2][:, :1, None, :].expand(B, new_bias.shape[1], q, -1)  # same for every head
        biases.insert(0, pending_bias)
    out_n, lse_n = masked_attention(query, keys, values, torch.cat(biases, -1), scaling)
    out, _ = merge_attention([(out_s, lse_s), (out_n, lse_n)])
    return out.to(query.dtype).transpose(1, 2).contiguous()


def _single_token_decode(step: Step, new: torch.Tensor | None) -> bool:
    """One real new token per row, nothing pending, a Store that keeps it: :func:`decode_step` /
    :func:`read_step` apply."""
    return step.layer.plain_decode(step.keys) and (new is None or bool(new.all()))


def _append_then(
    step: Step, query: torch.Tensor, position_ids: torch.Tensor | None, scaling: float, attend: Callable[[], Any]
) -> Any:
    """Append the step's token to the Store, then ``attend()``; if that raises, the token is rolled back
    (``CompressedLayer.truncate``) before the error propagates."""
    layer = step.layer
    seen = layer.seen
    layer.commit(step, query, position_ids, None, scaling)
    try:
        return attend()
    except BaseException:
        layer.truncate(seen)
        raise


def decode_step(step: Step, query: torch.Tensor, position_ids: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """One decode token over a Store with a fused ``attend``: append it first, then one ``attend`` over everything.

    The token attends to every stored entry and to itself, exactly what the Store holds once it is appended, so
    the separate attention over the new token and the ``merge_attention`` of :func:`fused_step` are not needed.
    If ``attend`` raises, the token is rolled back before the error propagates.
    """
    out, _ = _append_then(step, query, position_ids, scaling, lambda: step.layer.store.attend(query, scaling))
    return out.to(query.dtype).transpose(1, 2).contiguous()


def read_step(
    step: Step, query: torch.Tensor, position_ids: torch.Tensor | None, scaling: float, run: Callable[..., Any]
) -> Any:
    """One decode token over a Store without a fused ``attend``: append it first, then attend over ``read()``.

    The Store then holds exactly what ``[view | new]`` would be, without concatenating the whole cache each step
    (a copy of every held key and value per layer, which transformers' ``DynamicCache`` also makes): a Store whose
    view is zero-copy (``DenseStore`` with heads of equal length) is attended in place. ``run(keys, values, mask)``
    is the kernel; the mask is ``None`` when the view is ``bias_free`` or its bias is all zero (one host read),
    else the view's per-head bias repeated to the query heads. If reading or attention raises, the token is rolled
    back (``CompressedLayer.truncate``).
    """

    def attend() -> Any:
        view = step.layer.store.read(None)
        mask = None
        if not view.bias_free and bool(view.logit_bias.ne(0).any()):  # a zero bias runs the unmasked kernel
            dtype, group = query.dtype, query.shape[1] // view.keys.shape[1]
            bias = view.logit_bias.to(dtype).clamp_min(torch.finfo(dtype).min)
            mask = bias.repeat_interleave(group, dim=1)[:, :, None, :]
        return run(view.keys.to(query.dtype), view.values.to(query.dtype), mask)

    return _append_then(step, query, position_ids, scaling, attend)


def _valid_new(new: torch.Tensor | None, B: int, q: int) -> torch.Tensor | None:
    """``[B, q]`` bool: which of the step's tokens are real (a token attends to itself unless it is padding)."""
    if new is None:
        return None
    return torch.diagonal(new[:, 0], dim1=-2, dim2=-1).expand(B, q)


# -- the registered functions ------------------------------------------------------------------------------
def _make(base: Callable[..., Any], eager: bool) -> Callable[..., Any]:
    def attention(module, query, key, value, attention_mask, **kwargs):
        step = take_step(key)  # handed over by the kv_hf cache layer whose update returned `key`
        if step is None:
            return base(module, query, key, value, attention_mask, **kwargs)
        layer = step.layer
        if layer._step is not step:
            raise RuntimeError("stale kv_hf step: the key tensor was not produced by the current cache update")
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
        try:
            if step.appended and _single_token_decode(step, _new_token_mask(attention_mask, query.shape[2])):
                out = read_step(
                    step,
                    query,
                    kwargs.get("position_ids"),
                    scaling,
                    lambda k, v, mask: base(module, query, k, v, mask, **kwargs),
                )
                if step.on_commit is not None:
                    step.on_commit(layer)
                return out
            if step.appended:  # padding among the new tokens: the usual [view | new] path
                step.deferred = True
            if step.fused:
                new = _new_token_mask(attention_mask, query.shape[2])
                if _single_token_decode(step, new):
                    out = (decode_step(step, query, kwargs.get("position_ids"), scaling), None)
                    if step.on_commit is not None:
                        step.on_commit(layer)
                    return out
                out = (fused_step(step, query, new, scaling), None)
            else:
                if step.deferred:
                    key, value = layer.assemble(step, query)
                mask, new = step_mask(step, attention_mask, query, eager)
                out = base(module, query, key, value, mask, **kwargs)
        except BaseException:
            layer._step = None  # the step is abandoned; the next update must not report a missing commit
            raise
        B, q = query.shape[0], query.shape[2]  # every layer given the same mask shares one validity tensor
        valid = STEP.get("valid", (attention_mask, B, q), lambda: _valid_new(new, B, q))
        layer.commit(step, query, kwargs.get("position_ids"), valid, scaling)
        if step.on_commit is not None:
            step.on_commit(layer)
        return out

    attention.__name__ = f"kv_hf_{'eager' if eager else 'sdpa'}_attention"
    return attention


kv_hf_sdpa_attention = _make(_sdpa, eager=False)
kv_hf_eager_attention = _make(_eager, eager=True)


def register_attention() -> None:
    """Register ``"kv_hf"`` and ``"kv_hf_eager"`` with transformers' attention and mask interfaces (idempotent).

    Each reuses the mask builder of the kernel it wraps (boolean SDPA masks, additive float eager masks), so a
    non-kv_hf cache gets exactly the call it would get from ``"sdpa"`` / ``"eager"``.
    """
    AttentionInterface.register(KV_HF_SDPA, kv_hf_sdpa_attention)
    AttentionInterface.register(KV_HF_EAGER, kv_hf_eager_attention)
    AttentionMaskInterface.register(KV_HF_SDPA, sdpa_mask)
    AttentionMaskInterface.register(KV_HF_EAGER, eager_mask)


def enable_attention(model: PreTrainedModel) -> str:
    """Switch ``model`` to the kv_hf attention matching its current kernel; returns the new implementation name.

    ``sdpa`` becomes ``"kv_hf"`` and ``eager`` becomes ``"kv_hf_eager"``; already-switched models are left as they
    are. Other kernels (``flash_attention_*``, ``flex_attention``, hub kernels) cannot add a per-head logit bias:
    ``ValueError``. Behaviour with any non-kv_hf cache is unchanged (the functions delegate).
    """
    register_attention()
    impl = model.config._attn_implementation or "sdpa"
    if impl in KV_HF_IMPLEMENTATIONS:
        return impl
    if impl not in _WRAPS:
        raise ValueError(
            f"attention implementation {impl!r} cannot apply the per-head logit bias a compressed cache needs; "
            "load the model with attn_implementation='sdpa' or 'eager' (kv_hf wraps those two)"
        )
    model.set_attn_implementation(_WRAPS[impl])
    return _WRAPS[impl]


def disable_attention(model: PreTrainedModel) -> str:
    """Undo :func:`enable_attention`: back to ``sdpa`` / ``eager``; returns the implementation name."""
    impl = model.config._attn_implementation
    if impl in _UNWRAPS:
        model.set_attn_implementation(_UNWRAPS[impl])
        return _UNWRAPS[impl]
    return impl
