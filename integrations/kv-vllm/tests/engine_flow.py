"""The simulated vLLM engine flow shared by the packed-pool tests (test_vllm_packed.py, test_vllm_packed_codec.py):
one scheduler step of several requests over a block table, and the dense causal reference it is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Scheduled:
    """What one step hands to ``paged_attention``: the requests in order, their queries (``qs[i]``: ``[Q, Hq, D]``),
    the flat query, the query start offsets (``starts``, one more than requests), the context lengths after the
    step (``lens``) and the block table (``-1`` padded)."""

    reqs: list[int]
    qs: list[torch.Tensor]
    query: torch.Tensor
    starts: list[int]
    lens: list[int]
    table: torch.Tensor


def schedule(step, done, hist_k, hist_v, tables, N, Hq, D, staged) -> Scheduled:
    """Run the cache-write half of one engine step: for each request ``r`` in ``step`` (``{r: new tokens}``), the
    tokens ``done[r] .. done[r] + step[r]`` of its history (``hist_k[r]``: ``[H, L, D]``) are written to their slots
    in ``staged`` through the block table ``tables[r]``, and fresh random queries are drawn for them."""
    reqs = sorted(step)
    qs, ks, vs, slots, starts, lens = [], [], [], [], [0], []
    for r in reqs:
        a, b = done[r], done[r] + step[r]
        ks.append(hist_k[r][:, a:b].transpose(0, 1))
        vs.append(hist_v[r][:, a:b].transpose(0, 1))
        qs.append(torch.randn(b - a, Hq, D))
        slots += [tables[r][p // N] * N + p % N for p in range(a, b)]
        starts.append(starts[-1] + b - a)
        lens.append(b)
    staged.write(torch.cat(ks), torch.cat(vs), torch.tensor(slots))
    width = max(len(t) for t in tables)
    table = torch.full((len(reqs), width), -1, dtype=torch.int32)
    for i, r in enumerate(reqs):
        table[i, : len(tables[r])] = torch.tensor(tables[r])
    return Scheduled(reqs, qs, torch.cat(qs), starts, lens, table)


def dense_reference(q, keys, values, ctx, scale):
    """Causal attention of queries at positions ``ctx..`` over keys/values ``[H, L, D]`` (GQA), float32."""
    Hq, Q, _ = q.shape
    g = Hq // keys.shape[0]
    k = keys.float().repeat_interleave(g, 0)
    v = values.float().repeat_interleave(g, 0)
    logits = q.float() @ k.transpose(-1, -2) * scale
    mask = torch.arange(keys.shape[1])[None, :] <= torch.arange(ctx, ctx + Q)[:, None]
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), -1) @ v
