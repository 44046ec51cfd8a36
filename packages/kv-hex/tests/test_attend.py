"""HEXStore's fused ``attend`` (HEX §3.3, §3.5): equal to reference attention over ``read()``, part by part (never
the whole dequantized cache), and the per-token attention sums it adds to the heavy-hitter accumulators."""

import math

import pytest
import torch

from kv_hex import HEXConfig, HEXStore, hex_tiers, segment_attention
from kv_hex.kernels import dispatch, reference
from kv_hex.kernels.reference import decode_attention
from kvcore import Plan, reference_attention

B, H, G, D = 2, 2, 2, 16


def config(mode="append", **kw):
    return HEXConfig(bits=3, block_size=16, recent=2, heavy_ratio=0.1, rho=0.125, mode=mode, **kw)


def written(cfg, T, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g)
    k[..., 3] *= 6  # an outlier channel
    v = torch.randn(B, H, T, D, generator=g)
    keep = torch.ones(B, H, T, dtype=torch.bool)
    tiers = hex_tiers(torch.zeros(B, H, T), keep, torch.zeros_like(keep), cfg.bits, 0.1, cfg.recent, cfg.block_size)
    store = HEXStore(cfg)
    store.write(k.to(dtype), v.to(dtype), Plan(tiers), torch.arange(T).expand(B, T))
    return store


def query(seed, Q=1, dtype=torch.float32):
    return torch.randn(B, H * G, Q, D, generator=torch.Generator().manual_seed(100 + seed)).to(dtype)


def held_accumulators(store):
    """Every part's accumulator in entry order (zeros where none is held yet), and the part's (seg, pos)."""
    out = []
    for s in store._segments:
        acc = s.acc if s.acc is not None else torch.zeros(s.num_entries)
        out.append((acc.clone(), s.seg(), s.pos.long()))
    r = store._res
    acc = r["acc"] if r["acc"] is not None else torch.zeros(r["pos"].numel())
    seg = torch.repeat_interleave(torch.arange(r["counts"].numel()), r["counts"])
    out.append((acc.clone(), seg, r["pos"].long()))
    return out


def check_attend(store, q, scale=None):
    """attend == reference attention over read(); the accumulators grow by the dense probabilities of their
    entries (residual always; segments in full mode), summed over the queries and the GQA group."""
    view = store.read()
    want_out, want_lse = reference_attention(view, q, scale)
    _, _, dense_sums = decode_attention(q, view.keys, view.values, view.logit_bias, scale or 1 / math.sqrt(D))
    before = held_accumulators(store)
    out, lse = store.attend(q, scale)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    after = held_accumulators(store)
    for i, ((a0, seg, pos), (a1, _, _)) in enumerate(zip(before, after)):
        is_residual = i == len(before) - 1
        if not (is_residual or store.config.mode == "full"):
            assert torch.equal(a0, a1), "append mode must not accumulate into compressed segments"
            continue
        b, h = seg // H, seg % H
        t = (view.positions[b, h] == pos[:, None]).long().argmax(-1)  # the entry's column in read()
        torch.testing.assert_close(a1 - a0, dense_sums[b, h, t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["append", "full"])
def test_attend_equals_reference_over_read_after_appends(mode):
    """Write 37 tokens (two blocks + 5 in the residual), then decode 14 steps (a block end among them) with GQA
    and two queries a step: attend equals reference attention over read() at every step."""
    store = written(config(mode), 37)
    g = torch.Generator().manual_seed(1)
    for step in range(14):
        check_attend(store, query(step, Q=2), scale=0.3 if step % 2 else None)
        new = torch.randn(B, H, 1, D, generator=g)
        store.append(new, -new, torch.full((B, 1), 37 + step))
    assert len(store._segments) == (2 if mode == "append" else 1)
    check_attend(store, query(99))


@pytest.mark.parametrize("value_scope", ["layer", "head"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attend_half_precision_caches(value_scope, dtype):
    """fp16 / bf16 caches (codes dequantized and rounded to the cache dtype as read() does); queries in the same
    dtype; values grouped across KV heads (GEAR's KCVT, the default) or per head."""
    store = written(config(value_scope=value_scope, mask_scope="head"), 21, dtype=dtype)
    check_attend(store, query(0, dtype=dtype))


def test_attend_with_an_empty_residual():
    store = written(config(), 32)  # two full blocks: nothing left in the residual
    assert store.residual_lengths().sum() == 0
    check_attend(store, query(1))


def test_attend_with_the_residual_only():
    store = HEXStore(config())
    x = torch.randn(B, H, 5, D, generator=torch.Generator().manual_seed(3))
    store.append(x, x * 0.5, torch.arange(5).expand(B, 5))
    assert store.residual_lengths().tolist() == [[5, 5], [5, 5]] and not store._segments
    check_attend(store, query(2, Q=3))
    check_attend(store, query(3))  # the accumulator grows again


def test_fused_attend_falls_back_to_the_general_layout_for_ragged_parts(monkeypatch):
    """After an eviction neither the prompt's segment nor the residual is uniform: the fused path attends them as
    one general layout (kv_hex.layout.concat_layouts, one launch) and still equals reference attention over read();
    appends keep the residual ragged (its length per head is not known on the host) until a flush."""
    pytest.importorskip("triton")
    store = written(config(), 37)
    bits = store.tiers().key_bits.clone()
    bits[0, 0, ::3] = 0  # every part loses entries of (b=0, h=0)
    store.retier(Plan(bits))
    x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(4))
    store.append(x, -x, torch.full((B, 1), 37))
    launches = []
    real = dispatch.part_attention

    def spy(q, part, scale, logits=False):
        launches.append(part.num_entries)
        return real(q, part, scale, logits)

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(dispatch, "part_attention", spy)
    check_attend(store, query(4))
    assert launches == [sum(s.num_entries for s in store._segments) + int(store.residual_lengths().sum())]


def test_attend_ragged_heads_and_a_head_with_nothing():
    """Eviction through retier leaves heads of different lengths, one of them empty: out 0 and lse -inf there."""
    store = written(config(), 37)
    bits = store.tiers().key_bits.clone()
    bits[1, 1] = 0  # evict every entry of (b=1, h=1)
    bits[0, 0, ::3] = 0
    store.retier(Plan(bits))
    assert store.seq_lengths()[1, 1] == 0
    check_attend(store, query(4))
    out, lse = store.attend(query(4))
    assert bool(torch.isinf(lse[1, 2:]).all()) and bool((out[1, 2:] == 0).all())


def test_attend_never_builds_the_whole_dequantized_cache(monkeypatch):
    """attend neither calls read() nor dequantizes more than one part at a time: the CPU path attends part by part
    (each read in place as per-head blocks) and merges by log-sum-exp."""
    store = written(config(), 37)
    for step in range(16):  # one more compressed block: three parts besides the residual
        x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
        store.append(x, x, torch.full((B, 1), 37 + step))
    want = reference_attention(store.read(), query(5))
    sizes = []
    real = segment_attention.block_attention

    def spy(q, k, v, scale, logits=False):
        sizes.append(k.shape[0] * k.shape[1])
        return real(q, k, v, scale, logits)

    monkeypatch.setattr(segment_attention, "block_attention", spy)
    monkeypatch.setattr(reference, "dequantize_part", lambda *a: pytest.fail("attend took the layout path"))
    monkeypatch.setattr(HEXStore, "read", lambda *a: pytest.fail("attend called read()"))
    out, lse = store.attend(query(5))
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want[1], rtol=1e-5, atol=1e-5)
    parts = [s.num_entries for s in store._segments] + [int(store.residual_lengths().sum())]
    assert sizes == parts == [128, 64, 20], f"attended {sizes}, parts hold {parts}"


@pytest.mark.parametrize("mode", ["append", "full"])
def test_attend_through_the_triton_kernels(monkeypatch, mode):
    """The whole store on the Triton path (interpreted on CPU): attend and read equal the PyTorch path. In append
    mode the store holds two compressed segments and the residual, which the Triton path attends as one layout
    (kv_hex.layout.concat_layouts, one launch) and the PyTorch path part by part."""
    pytest.importorskip("triton")

    def grown():
        store = written(config(mode), 37)
        for step in range(16):  # one more compressed block in append mode
            x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
            store.append(x, -x, torch.full((B, 1), 37 + step))
        return store

    store = grown()
    want_view = store.read()
    want = store.attend(query(6, Q=2))
    want_acc = [a for a, _, _ in held_accumulators(store)]
    store = grown()
    if mode == "append":
        assert len(store._segments) == 2
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    view = store.read()
    assert torch.equal(view.keys, want_view.keys) and torch.equal(view.values, want_view.values)
    got = store.attend(query(6, Q=2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, (b, _, _) in zip(want_acc, held_accumulators(store)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_concat_layouts_address_every_part_in_one_layout():
    """Two compressed segments and the residual as one layout: each head's entries contiguous, and the entries
    read back (codes dequantized, overlay merged, full rows) are the parts' own entries in the returned order."""
    from kv_hex.layout import concat_layouts

    store = written(config(), 37)
    for step in range(16):
        x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
        store.append(x, -x, torch.full((B, 1), 37 + step))
    parts = [p for p in store._layouts() if p.num_entries]
    assert len(parts) == 3
    combined, order = concat_layouts(parts)
    assert combined.num_entries == sum(p.num_entries for p in parts)
    assert torch.equal(combined.count.long(), sum(p.count.long() for p in parts))
    assert torch.equal(combined.seg(), torch.cat([p.seg() for p in parts])[order])  # heads contiguous
    keys, values = zip(*(reference.dequantize_part(p) for p in parts))
    got_k, got_v = reference.dequantize_part(combined)
    assert torch.equal(got_k, torch.cat(keys)[order]) and torch.equal(got_v, torch.cat(values)[order])
    # every part's values share their keys' entry maps (HEX keeps whole tokens), so the combined layout does too
    assert all(p.v.idx is p.k.idx for p in parts) and combined.v.idx is combined.k.idx


def test_the_fused_kernel_takes_an_upper_bound_of_the_longest_head():
    """The store hands the fused kernel a host-side upper bound of its longest head (no read of the counts): a
    bound past the real length only adds masked tiles, so the output, lse and logits are those of the exact
    length, ragged heads included."""
    pytest.importorskip("triton")
    from kv_hex.kernels.triton_attention import part_attention_triton
    from kv_hex.layout import concat_layouts

    store = written(config(), 37)
    bits = store.tiers().key_bits.clone()
    bits[0, 0, ::3] = 0  # ragged heads
    store.retier(Plan(bits))
    for step in range(16):
        x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
        store.append(x, -x, torch.full((B, 1), 37 + step))
    assert len(set(store.seq_lengths().flatten().tolist())) > 1
    parts = [p for p in store._layouts() if p.num_entries]
    exact, order = concat_layouts(parts)
    loose, order2 = concat_layouts(parts, exact.T + 40)
    assert loose.T == exact.T + 40 and torch.equal(order, order2)
    q = query(3, Q=2)
    want = part_attention_triton(q, exact, 0.3, logits=True, block_t=16, max_blocks=2)
    got = part_attention_triton(q, loose, 0.3, logits=True, block_t=16, max_blocks=2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("value_scope", "mask_scope"), [("layer", "layer"), ("head", "head")])
def test_decode_blocks_through_the_triton_kernels_in_two_launches(monkeypatch, value_scope, mask_scope):
    """A long decode on the Triton path (interpreted on CPU): the decode blocks are attended as one stack and the
    prompt's segment with the residual in one launch, both addressed by arithmetic (kv_hex.uniform): two launches
    of the fused kernel however many blocks the layer holds, with attend, lse and the residual's accumulator equal
    to the PyTorch path's."""
    pytest.importorskip("triton")
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    def grown(blocks):
        store = written(config(value_scope=value_scope, mask_scope=mask_scope), 37)
        for step in range(16 * blocks):  # one compressed block per 16 decoded tokens
            x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
            store.append(x, -x, torch.full((B, 1), 37 + step))
        return store

    launches = []
    real, real_uniform = dispatch.part_attention, dispatch.uniform_attention

    def spy(q, part, scale, logits=False):
        launches.append(("layout", part.num_entries))
        return real(q, part, scale, logits)

    def spy_uniform(q, calls, scale):
        launches.extend(("uniform", c.part.num_entries) for c in calls)  # one kernel launch per call, one merge
        return real_uniform(q, calls, scale)

    for blocks in (1, 3, 5):  # one block: a stack of one
        store = grown(blocks)
        want = store.attend(query(7))
        want_acc = held_accumulators(store)[-1][0]
        store = grown(blocks)
        assert len(store._segments) == 1 + blocks
        with monkeypatch.context() as mp:
            mp.setattr(dispatch, "use_triton", lambda t: True)
            mp.setattr(dispatch, "part_attention", spy)
            mp.setattr(dispatch, "uniform_attention", spy_uniform)
            launches.clear()
            got = store.attend(query(7))
        # the stack of decode blocks; the prompt's segment + the residual: both uniform, addressed by arithmetic
        n = store.config.block_size
        assert launches == [("uniform", blocks * B * H * n), ("uniform", store._segments[0].num_entries)], launches
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(held_accumulators(store)[-1][0], want_acc, rtol=1e-5, atol=1e-6)
        # what the stack needs from the host is read once per segment: a second attend reads nothing
        with monkeypatch.context() as mp, value_checks(False), HostReads(sites=True) as reads:
            mp.setattr(dispatch, "use_triton", lambda t: True)
            store.attend(query(8))
        assert reads.total == 0, dict(reads.by_site)


def test_a_fused_decode_step_does_not_grow_with_the_decode_blocks(monkeypatch):
    """On the fused path the work a step launches is the same with 2 or 6 decode blocks held: the blocks are one
    stack, so the tensor operations of attend (each a launch or more on a GPU) do not grow with them (they did by
    ~100 per block while every block's layout was built and concatenated each step)."""
    pytest.importorskip("triton")
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvcore import value_checks

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += "view" not in str(func)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    store = written(config(), 37)
    q = query(9)
    counts = {}
    step = 0
    for blocks in (2, 6):
        while len(store._segments) < 1 + blocks:
            x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
            store.append(x, x, torch.full((B, 1), 37 + step))
            step += 1
        store.attend(q)  # what is read once per segment is read here
        with value_checks(False), Ops() as ops:
            store.attend(q)
        counts[blocks] = ops.n
    assert counts[2] == counts[6] > 0, counts


def test_stacks_of_decode_blocks_are_kept_between_steps_without_holding_bytes_twice():
    """The decode blocks' stack is built once per set of blocks: the blocks then hold views of it, so a step
    concatenates nothing and the store holds exactly the bytes of the same store never attended (a copy per step, or
    a stack kept beside the blocks, would show); attend stays equal to reference attention over read()."""

    def grown(steps, attend):
        store = written(config(), 37)
        for step in range(steps):
            x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
            store.append(x, -x, torch.full((B, 1), 37 + step))
            if attend:
                store.attend(query(step))
        return store

    quiet, busy = grown(16 * 3 + 5, False), grown(16 * 3 + 5, True)
    assert len(busy._segments) == 4 and len(busy._stack_cache) == 1
    acc = busy._res["acc"].numel() * 4  # the residual's heavy-hitter accumulator, which only attend creates
    assert quiet._res["acc"] is None and busy.nbytes() == quiet.nbytes() + acc
    (blocks, stack) = next(iter(busy._stack_cache.values()))
    assert [b.k_codes.untyped_storage().data_ptr() for b in blocks] == [stack.k_codes.untyped_storage().data_ptr()] * 3
    check_attend(busy, query(99))
    cats = []
    real = torch.cat

    def counting_cat(*args, **kwargs):
        cats.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "cat", counting_cat)
        busy.attend(query(98))
        busy.attend(query(97))
    quiet.attend(query(98))  # builds the stack (concatenations the kept one spares) and the accumulator
    assert busy.nbytes() == quiet.nbytes()
    assert len(cats) == 0, f"{len(cats)} concatenations in two steps with a kept stack"


def test_a_dropped_stack_leaves_its_blocks_holding_only_their_own_bytes():
    """kv_hex.segment.compact: a block that stays held after its stack is dropped gets storages of its own (a view
    of the stack would keep every block's bytes alive and counted); its values are unchanged."""
    from kv_hex.segment import compact, share_stack, stack_segments
    from kvcore import reachable_bytes

    store = written(config(), 37)
    for step in range(32):
        x = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(step))
        store.append(x, -x, torch.full((B, 1), 37 + step))
    blocks = store._segments[1:]
    own = [reachable_bytes(b) for b in blocks]
    before = [b.k_codes.clone() for b in blocks]
    assert share_stack(blocks, stack_segments(blocks))
    assert reachable_bytes(blocks[0]) == sum(own)  # a view keeps the whole stack's storages
    compact(blocks[0])
    assert reachable_bytes(blocks[0]) == own[0] and torch.equal(blocks[0].k_codes, before[0])
    assert torch.equal(blocks[1].k_codes, before[1])
