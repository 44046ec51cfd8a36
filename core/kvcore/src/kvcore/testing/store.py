"""``StoreTests`` (DESIGN.md §3): nothing is lost that the plan did not drop (the 16 tier bit-exact, quantized
tiers within a min-max bound), true positions in ascending order, ``-inf`` bias exactly on padding, attention
over the view = attention over the kept entries, ``nbytes`` = storage reachable from the store and nothing held
for evicted entries, append after compression, crop, reorder, reset, clear errors.

Fixture ``store_factory`` (a callable making an empty store, e.g. ``return lambda: MyStore(page=16)``). Flags:
``quantized_bits`` (widths held besides 0 and 16; default ``supported_bits - {0, 16}``), ``quantized_key_bits`` /
``quantized_value_bits`` (default ``quantized_bits``; plans draw key and value tiers independently over the same
kept set), ``same_kv_tiers`` (values take the key tiers; default False), ``supports_crop``, ``supports_reorder``,
``lossless_full_tier`` (the 16 tier reads back bit-exact), ``lossless_append`` (appended entries read back
bit-exact, earlier ones unchanged); True by default. Hook ``max_quantization_error(x, bits)`` bounds the error of
one head's ``bits``-wide entries (default: uniform min-max grouped along tokens or channels).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

from kvcore.plan import EVICT, FULL, Plan
from kvcore.testing.base import StandardTests, forall, reachable_bytes
from kvcore.testing.strategies import SEEDS, dtypes, fill, left_padded_masks
from kvcore.view import KVView

SIZES = st.sampled_from((4, 8, 16))  # head dims


@st.composite
def cases(draw, widths: tuple[tuple[int, ...], tuple[int, ...] | None], min_keep: int = 0,
          kinds=("normal", "plateau", "huge")):
    """``(keys, values, plan, positions)``: a left-padded batch, a third of the real entries evicted, the others
    at ``FULL`` or a width of ``widths = (key widths, value widths or None for "same as the keys")``."""
    B, H, T, D = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 24)), draw(SIZES)
    dtype, kind, seed, valid = draw(dtypes()), draw(st.sampled_from(kinds)), draw(SEEDS), draw(left_padded_masks(B, T))
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(B, H, T, generator=g) > 1 / 3) & valid[:, None, :]
    if min_keep:
        keep[..., -1] |= keep.sum(-1) < min_keep
    tier = [torch.tensor((FULL, FULL, *w), dtype=torch.uint8)[torch.randint(len(w) + 2, (B, H, T), generator=g)]
            for w in widths if w is not None]
    kb, vb = (t.masked_fill(~keep, EVICT) for t in (tier[0], tier[-1]))
    positions = torch.where(valid, valid.long().cumsum(-1) - 1 + draw(st.integers(0, 5)), 0)
    keys, values = fill((B, H, T, D), dtype, kind, seed), fill((B, H, T, D), dtype, kind, seed + 1)
    return keys, values, Plan(kb, None if widths[1] is None else vb), positions


def entries(pos: torch.Tensor, *per_entry: torch.Tensor) -> dict:
    """``{(b, h): (positions, *per_entry)}`` of the entries with ``pos >= 0`` (``pos`` ``[B, H, T]``; each tensor of
    ``per_entry`` is ``[B, H, T, ...]``: keys, values, tiers, logit bias ...)."""
    return {(b, h): tuple(t[b, h][pos[b, h] >= 0] for t in (pos, *per_entry))
            for b in range(pos.shape[0]) for h in range(pos.shape[1])}


def written(keys, values, plan: Plan, positions) -> dict:
    """The entries a plan keeps as ``(positions, keys, values, key tiers, value tiers)``, in position order."""
    pos = torch.where(plan.keep_keys, positions[:, None, :].expand(plan.key_bits.shape), -1)
    return entries(pos, keys, values, plan.key_bits, plan.bits_for_values)


class StoreTests(StandardTests):
    """Standard tests for a ``kvcore.Store``."""

    quantized_bits: tuple[int, ...] | None = None
    quantized_key_bits: tuple[int, ...] | None = None
    quantized_value_bits: tuple[int, ...] | None = None
    same_kv_tiers: bool = False
    supports_crop: bool = True
    supports_reorder: bool = True
    lossless_full_tier: bool = True
    lossless_append: bool = True

    @pytest.fixture
    def store_factory(self):
        raise NotImplementedError("override the `store_factory` fixture: return a callable making an empty Store")

    def max_quantization_error(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """Bound on ``|read - x|`` for one head's ``bits``-wide entries ``x`` ``[n, D]``: half a min-max step of the
        wider of the entry's channel range (over these entries) and its token range (over channels)."""
        x = x.float()
        ch, tok = x.max(0).values - x.min(0).values, x.max(1).values - x.min(1).values
        return 0.5 * torch.maximum(ch[None, :], tok[:, None]) / (2**bits - 1)

    def widths(self, store_factory) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        both = tuple(self.flag("quantized_bits", sorted(set(store_factory().supported_bits) - {EVICT, FULL})))
        keys, values = self.flag("quantized_key_bits", both), self.flag("quantized_value_bits", both)
        return tuple(keys), None if self.same_kv_tiers else tuple(values)

    def written_store(self, store_factory, case):
        store = store_factory()
        store.write(*case)
        return store

    def assert_entries(self, got: dict, want: dict, exact: bool = True) -> None:
        """Same heads and positions; full-tier rows identical (if ``exact``), quantized rows within the bound.
        ``want`` holds ``(positions, keys, values[, key tiers, value tiers])`` (no tiers: all ``FULL``)."""
        assert got.keys() == want.keys()
        for head, (gp, gk, gv) in got.items():
            wp, wk, wv, *tiers = want[head]
            wkb, wvb = tiers or (torch.full_like(wp, FULL),) * 2
            assert torch.equal(gp.long(), wp.long()), f"head {head}: positions {gp.tolist()} != kept {wp.tolist()}"
            for g, w, wb in ((gk, wk, wkb), (gv, wv, wvb)):
                assert g.dtype == w.dtype, f"read back {g.dtype}, wrote {w.dtype}"
                if exact and self.lossless_full_tier:
                    assert torch.equal(g[wb == FULL], w[wb == FULL]), f"head {head}: full-precision entries changed"
                for bits in set(wb[wb != FULL].tolist()):
                    m, fi = wb == bits, torch.finfo(w.dtype)
                    gf, wf, bound = g[m].float(), w[m].float(), self.max_quantization_error(w[m], bits)
                    slack = bound * 2.0**bits * 2e-3 + fi.eps * (gf.abs() + wf.abs() + fi.tiny)
                    assert bool(((gf - wf).abs() <= bound + slack).all()), f"head {head}: {bits}-bit error too large"

    def check_view(self, store, want: dict | None = None, exact: bool = True) -> KVView:
        """Read; check the view's structure, ``seq_lengths``, ``nbytes`` and (if given) the entries."""
        v = store.read()
        assert isinstance(v, KVView) and v.keys.shape == v.values.shape and v.positions.shape == v.keys.shape[:3]
        assert v.positions.dtype == torch.int64 and v.logit_bias.dtype == torch.float32
        assert torch.equal(torch.isneginf(v.logit_bias), v.positions == -1), "-inf bias must mark padding exactly"
        assert not bool(v.logit_bias.isnan().any() | v.logit_bias.isposinf().any()), "bias must be finite or -inf"
        assert bool(torch.isfinite(v.keys).all() & torch.isfinite(v.values).all()), "padding must be finite"
        for head, (p,) in entries(v.positions).items():
            assert bool((p[1:] > p[:-1]).all()), f"head {head}: positions {p.tolist()} are not ascending"
        assert torch.equal(store.seq_lengths().cpu(), (v.positions >= 0).sum(-1).cpu()), "seq_lengths != entries read"
        assert store.nbytes() == reachable_bytes(store), "nbytes() != bytes of the tensors the store holds"
        assert store.nbytes(device="cpu") == reachable_bytes(store, "cpu")
        if want is not None:
            self.assert_entries(entries(v.positions, v.keys, v.values), want, exact)
        return v

    def append(self, store, like: torch.Tensor, last: torch.Tensor, n: int, seed: int) -> dict:
        """Append ``n`` entries per head at positions ``last + 1 ..`` (``last`` ``[B]``); returns them."""
        B, H, _, D = like.shape
        pos = last[:, None] + 1 + torch.arange(n)
        k, v = fill((B, H, n, D), like.dtype, seed=seed), fill((B, H, n, D), like.dtype, seed=seed + 1)
        store.append(k, v, pos)
        return entries(pos[:, None, :].expand(B, H, n), k, v)

    def test_write_read_roundtrip(self, store_factory) -> None:
        def check(case):
            self.check_view(self.written_store(store_factory, case), written(*case))

        forall(cases(self.widths(store_factory)), check)

    def test_attend_matches_reference(self, store_factory) -> None:
        def check(args):
            case, group, seed = args
            view = self.written_store(store_factory, case).read()
            B, H, _, D = view.keys.shape
            q = fill((B, H * group, 3, D), seed=seed)
            out = view.attend(q)
            for (b, h), (_, k, v, bias) in entries(view.positions, view.keys, view.values, view.logit_bias).items():
                for j in range(h * group, (h + 1) * group):
                    logits = q[b, j] @ k.float().T / math.sqrt(D) + bias
                    w = (logits - logits.amax(-1, keepdim=True)).exp()
                    torch.testing.assert_close(out[b, j], w @ v.float() / w.sum(-1, keepdim=True), rtol=1e-4, atol=1e-4)

        cs = cases(self.widths(store_factory), min_keep=1, kinds=("normal", "plateau"))
        forall(st.tuples(cs, st.sampled_from((1, 2, 4)), SEEDS), check)

    def test_evicted_entries_hold_no_memory(self, store_factory) -> None:
        def check(args):
            (B, H, D, k, seed), T = args, 48
            x, pos, ones = fill((B, H, T, D), seed=seed), torch.arange(T).expand(B, T), torch.ones(B, H, T).bool()
            keep = torch.rand(B, H, T, generator=torch.Generator().manual_seed(seed)).argsort(-1).argsort(-1) < k
            evicted = self.written_store(store_factory, (x, x, Plan.from_keep(keep), pos))
            xk = x[:, :, :k]
            prefix = self.written_store(store_factory, (xk, xk, Plan.from_keep(ones[..., :k]), pos[:, :k]))
            full = self.written_store(store_factory, (x, x, Plan.from_keep(ones), pos))
            assert evicted.nbytes() == prefix.nbytes() < full.nbytes(), "evicted entries still hold memory"
            full.write(x, x, Plan.from_keep(keep), pos)
            assert full.nbytes() == evicted.nbytes() == reachable_bytes(full), "write() kept the old content's memory"

        forall(st.tuples(st.integers(1, 2), st.integers(1, 3), SIZES, st.integers(1, 24), SEEDS), check, 10)

    def test_append_after_compression(self, store_factory) -> None:
        def check(args):
            case, n, seed = args
            store = self.written_store(store_factory, case)
            v, lens = store.read(), store.seq_lengths().clone()
            before = entries(v.positions, v.keys, v.values)
            new = self.append(store, case[0], case[3].max(-1).values, n, seed)
            assert torch.equal(store.seq_lengths(), lens + n), "append must add n entries per head"
            want = {h: tuple(torch.cat(p) for p in zip(before[h], new[h])) for h in before}
            self.check_view(store, want, self.lossless_append)

        forall(st.tuples(cases(self.widths(store_factory)), st.integers(1, 4), SEEDS), check)

    def test_crop(self, store_factory) -> None:
        self.require(self.supports_crop, "supports_crop=False")

        def check(args):
            case, n, seed, frac = args
            store = self.written_store(store_factory, case)
            self.append(store, case[0], case[3].max(-1).values, n, seed)
            v = store.read()
            before, cut = entries(v.positions, v.keys, v.values), round(frac * (int(v.positions.max()) + 1))
            store.crop(cut)
            self.check_view(store, {h: tuple(t[e[0] < cut] for t in e) for h, e in before.items()})
            kept = store.seq_lengths().clone()
            self.append(store, case[0], torch.full((case[0].shape[0],), cut - 1), 2, seed + 7)
            assert torch.equal(store.seq_lengths(), kept + 2), "append after crop must add its entries"
            self.check_view(store)

        forall(st.tuples(cases(self.widths(store_factory)), st.integers(1, 3), SEEDS, st.floats(0, 1)), check)

    def test_reorder(self, store_factory) -> None:
        self.require(self.supports_reorder, "supports_reorder=False")

        def check(args):
            case, seed = args
            store, (B, H) = self.written_store(store_factory, case), case[0].shape[:2]
            v, lens = store.read(), store.seq_lengths().clone()
            before = entries(v.positions, v.keys, v.values)
            index = torch.randint(B, (B,), generator=torch.Generator().manual_seed(seed))
            store.reorder(index)
            assert torch.equal(store.seq_lengths(), lens[index]), "seq_lengths must follow the new batch order"
            self.check_view(store, {(i, h): before[int(index[i]), h] for i in range(B) for h in range(H)})

        forall(st.tuples(cases(self.widths(store_factory)), SEEDS), check)

    def test_reset_frees_memory(self, store_factory) -> None:
        def check(case):
            store = self.written_store(store_factory, case)
            store.reset()
            assert store.nbytes() == 0 == reachable_bytes(store), "reset() must free every tensor"
            with pytest.raises(ValueError):
                store.read()
            store.write(*case)
            self.check_view(store, written(*case))

        forall(cases(self.widths(store_factory)), check, 8)

    def test_read_empty_store_raises(self, store_factory) -> None:
        with pytest.raises(ValueError):
            store_factory().read()

    def test_rejects_bad_input(self, store_factory) -> None:
        x, pos, one = torch.randn(2, 2, 6, 8), torch.arange(6).expand(2, 6), torch.randn(2, 2, 1, 8)
        p1 = torch.full((2, 1), 6)
        plan, plan7 = Plan.from_keep(torch.ones(2, 2, 6).bool()), Plan.from_keep(torch.ones(2, 2, 7).bool())
        odd = [b for b in range(1, 16) if b not in store_factory().supported_bits]
        bad = {  # name: (write a valid layer first?, the call that must raise)
            "plan of another shape": (False, lambda s: s.write(x, x, plan7, pos)),
            "positions of another shape": (False, lambda s: s.write(x, x, plan, pos[:, :5])),
            "float positions": (False, lambda s: s.write(x, x, plan, pos.float())),
            "values of another shape": (False, lambda s: s.write(x, x[..., :4], plan, pos)),
            "values of another dtype": (False, lambda s: s.write(x, x.half(), plan, pos)),
            "integer keys": (False, lambda s: s.write(x.int(), x.int(), plan, pos)),
            "an unsupported tier": (False, lambda s: s.write(x, x, Plan(torch.full((2, 2, 6), odd[0]).byte()), pos)),
            "append with other heads": (True, lambda s: s.append(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8), p1)),
            "append with another dtype": (True, lambda s: s.append(one.half(), one.half(), p1)),
            "append with another head_dim": (True, lambda s: s.append(one[..., :4], one[..., :4], p1)),
            "append with positions of another shape": (True, lambda s: s.append(one, one, torch.full((2, 2), 6))),
        }
        if not odd:  # the store holds every width
            del bad["an unsupported tier"]
        for what, (setup, call) in bad.items():
            store = store_factory()
            if setup:
                store.write(x, x, plan, pos)
            with pytest.raises((ValueError, TypeError)):
                call(store)
                pytest.fail(f"no error for {what}")
