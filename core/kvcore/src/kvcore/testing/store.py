"""``StoreTests``: the Store contract (DESIGN.md §3) — nothing is lost that the plan did not drop (the full
tier bit-exact, quantized tiers within a min-max bound), true positions, ``-inf`` bias on padding only,
``nbytes`` equal to the storage reachable from the store and nothing held for evicted entries, append after
compression, crop, reorder, reset, clear errors.

Adopt::

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store_factory(self):
            return lambda: MyStore(page=16)

Fixture ``store_factory`` (returns a callable making an empty store). Flags: ``quantized_bits`` (widths it
holds besides 0 and 16; default ``supported_bits - {0, 16}``), ``supports_crop``, ``supports_reorder``,
``lossless_full_tier`` (the 16 tier reads back bit-exact), ``lossless_append`` (appended entries read back
bit-exact and earlier entries unchanged); all default True. Hook ``max_quantization_error(x, bits)`` bounds the
error of a head's ``bits``-wide entries (default: uniform min-max grouped along tokens or channels).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

from kvcore.plan import EVICT, FULL, Plan
from kvcore.testing.base import StandardTests, forall
from kvcore.testing.strategies import SEEDS, dtypes, fill, left_padded_masks
from kvcore.testing.walk import reachable_bytes
from kvcore.view import KVView

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # positions, keys, values, bits


@st.composite
def cases(draw, widths: tuple[int, ...], min_keep: int = 0, max_t: int = 24, kinds=("normal", "plateau", "huge")):
    """``(keys, values, plan, positions)``: left-padded batch, random tiers from ``widths``, padding evicted."""
    B, H, T, D = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, max_t)), draw(st.sampled_from((4, 8, 16)))
    dtype, kind, seed = draw(dtypes()), draw(st.sampled_from(kinds)), draw(SEEDS)
    valid = draw(left_padded_masks(B, T))
    positions = torch.where(valid, valid.long().cumsum(-1) - 1 + draw(st.integers(0, 5)), 0)
    g = torch.Generator().manual_seed(seed)
    bits = torch.tensor(widths, dtype=torch.uint8)[torch.randint(len(widths), (B, H, T), generator=g)]
    bits = bits.masked_fill(~valid[:, None, :], EVICT)
    if min_keep:
        bits[..., -1] = torch.where((bits != EVICT).sum(-1) < min_keep, FULL, bits[..., -1])
    return fill((B, H, T, D), dtype, kind, seed), fill((B, H, T, D), dtype, kind, seed + 1), Plan(bits), positions


def expected(keys, values, plan: Plan, positions) -> dict[tuple[int, int], Entries]:
    """Per head, the kept entries in position order."""
    B, H, T, _ = keys.shape
    out = {}
    for b in range(B):
        for h in range(H):
            m = plan.key_bits[b, h] != EVICT
            order = torch.argsort(positions[b][m], stable=True)
            out[b, h] = (positions[b][m][order].long(), keys[b, h][m][order], values[b, h][m][order],
                         plan.key_bits[b, h][m][order])
    return out


def entries(view: KVView) -> dict[tuple[int, int], Entries]:
    """Per head, the view's valid entries (asserting they come in ascending position order)."""
    out = {}
    for b in range(view.keys.shape[0]):
        for h in range(view.keys.shape[1]):
            m = view.positions[b, h] >= 0
            pos = view.positions[b, h][m]
            assert bool((pos[1:] > pos[:-1]).all()), f"head ({b}, {h}): positions not ascending: {pos.tolist()}"
            out[b, h] = (pos, view.keys[b, h][m], view.values[b, h][m], torch.full_like(pos, FULL))
    return out


class StoreTests(StandardTests):
    """Standard tests for a ``kvcore.Store``."""

    quantized_bits: tuple[int, ...] | None = None
    supports_crop: bool = True
    supports_reorder: bool = True
    lossless_full_tier: bool = True
    lossless_append: bool = True

    @pytest.fixture
    def store_factory(self):
        raise NotImplementedError("override the `store_factory` fixture: return a callable making an empty Store")

    def max_quantization_error(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """Bound on ``|read - x|`` for one head's entries ``x`` ``[n, D]`` stored at ``bits``: half a min-max step
        of the wider of the entry's channel range (over these entries) and its token range (over channels)."""
        x = x.float()
        ch, tok = x.max(0).values - x.min(0).values, x.max(1).values - x.min(1).values
        return 0.5 * torch.maximum(ch[None, :], tok[:, None]) / (2**bits - 1)

    # -- helpers ---------------------------------------------------------------------------------------
    def _widths(self, store_factory) -> tuple[int, ...]:
        q = self.flag("quantized_bits", tuple(sorted(set(store_factory().supported_bits) - {EVICT, FULL})))
        return (EVICT, FULL, FULL, *q)

    def _written(self, store_factory, case):
        store = store_factory()
        store.write(*case)
        return store

    def assert_entries(self, got: dict, want: dict, exact: bool = True) -> None:
        """Same heads, positions and rows; rows of width ``< 16`` (or all if not ``exact``) within the bound."""
        assert got.keys() == want.keys()
        for head, (gp, gk, gv, _) in got.items():
            wp, wk, wv, wb = want[head]
            assert torch.equal(gp.long(), wp.long()), f"head {head}: positions {gp.tolist()} != kept {wp.tolist()}"
            for g, w in ((gk, wk), (gv, wv)):
                assert g.dtype == w.dtype, f"read back {g.dtype}, wrote {w.dtype}"
                full = wb == FULL
                if exact and self.lossless_full_tier:
                    assert torch.equal(g[full], w[full]), f"head {head}: full-precision entries changed"
                for bits in set(wb[~full].tolist()):
                    m = wb == bits
                    gf, wf = g[m].float(), w[m].float()
                    bound = self.max_quantization_error(w[m], bits)
                    fi = torch.finfo(w.dtype)
                    slack = bound * 2.0**bits * 2e-3 + fi.eps * (gf.abs() + wf.abs() + fi.tiny)
                    assert bool(((gf - wf).abs() <= bound + slack).all()), f"head {head}: {bits}-bit error over bound"

    def check_view(self, store, want: dict | None = None, exact: bool = True) -> KVView:
        """Read, check the view's structure and (if given) its entries; also ``seq_lengths`` and ``nbytes``."""
        view = store.read()
        assert isinstance(view, KVView)
        assert view.keys.shape == view.values.shape and view.positions.shape == view.keys.shape[:3]
        assert view.positions.dtype == torch.int64 and view.logit_bias.dtype == torch.float32
        assert torch.equal(torch.isneginf(view.logit_bias), view.positions == -1), "-inf bias must mark padding exactly"
        assert not bool(view.logit_bias.isnan().any() | view.logit_bias.isposinf().any())
        assert bool(torch.isfinite(view.keys).all() & torch.isfinite(view.values).all()), "padding must be finite"
        assert torch.equal(store.seq_lengths().cpu(), (view.positions >= 0).sum(-1).cpu()), "seq_lengths != entries read"
        assert store.nbytes() == reachable_bytes(store), "nbytes() != bytes of the tensors the store holds"
        assert store.nbytes(device="cpu") == reachable_bytes(store, "cpu")
        if want is not None:
            self.assert_entries(entries(view), want, exact)
        return view

    # -- tests -----------------------------------------------------------------------------------------
    def test_write_read_roundtrip(self, store_factory) -> None:
        forall(cases(self._widths(store_factory)),
               lambda c: self.check_view(self._written(store_factory, c), expected(*c)))

    def test_attend_matches_reference(self, store_factory) -> None:
        def check(args):
            case, group, seed = args
            view = self._written(store_factory, case).read()
            B, H, _, D = view.keys.shape
            q = fill((B, H * group, 3, D), torch.float32, "normal", seed)
            out = view.attend(q)
            for (b, h), (pos, k, v, _) in entries(view).items():
                bias = view.logit_bias[b, h][view.positions[b, h] >= 0]
                for j in range(h * group, (h + 1) * group):
                    p = torch.softmax(q[b, j] @ k.float().T / math.sqrt(D) + bias, -1)
                    torch.testing.assert_close(out[b, j], p @ v.float(), rtol=1e-4, atol=1e-4)

        widths = self._widths(store_factory)
        forall(st.tuples(cases(widths, min_keep=1, kinds=("normal", "plateau")), st.sampled_from((1, 2, 4)), SEEDS), check)

    def test_evicted_entries_hold_no_memory(self, store_factory) -> None:
        def check(args):
            B, H, D, k, dtype, seed = args
            x, T = fill((B, H, 48, D), dtype, "normal", seed), 48
            pos = torch.arange(T).expand(B, T)
            rank = torch.rand(B, H, T, generator=torch.Generator().manual_seed(seed)).argsort(-1).argsort(-1)
            evicted = self._written(store_factory, (x, x, Plan.from_keep(rank < k), pos))
            prefix = self._written(store_factory, (x[:, :, :k], x[:, :, :k], Plan.from_keep(torch.ones(B, H, k, dtype=torch.bool)), pos[:, :k]))
            full = self._written(store_factory, (x, x, Plan.from_keep(torch.ones(B, H, T, dtype=torch.bool)), pos))
            assert evicted.nbytes() == prefix.nbytes() < full.nbytes(), "evicted entries still hold memory"
            full.write(x, x, Plan.from_keep(rank < k), pos)
            assert full.nbytes() == evicted.nbytes() == reachable_bytes(full), "write() kept the previous content's memory"

        forall(st.tuples(st.integers(1, 2), st.integers(1, 3), st.sampled_from((4, 8, 16)), st.integers(1, 24), dtypes(), SEEDS), check, 10)

    def _append(self, store, B, H, D, dtype, positions, n, seed):
        start = positions.max(-1).values + 1
        pos = start[:, None] + torch.arange(n)
        k, v = fill((B, H, n, D), dtype, "normal", seed), fill((B, H, n, D), dtype, "normal", seed + 1)
        store.append(k, v, pos)
        return {(b, h): (pos[b], k[b, h], v[b, h], torch.full((n,), FULL)) for b in range(B) for h in range(H)}

    def test_append_after_compression(self, store_factory) -> None:
        def check(args):
            case, n, seed = args
            store = self._written(store_factory, case)
            before, lens = entries(store.read()), store.seq_lengths().clone()
            B, H, _, D = case[0].shape
            new = self._append(store, B, H, D, case[0].dtype, case[3], n, seed)
            assert torch.equal(store.seq_lengths(), lens + n), "append must add n entries per head"
            want = {h: tuple(torch.cat([a, b]) for a, b in zip(before[h], new[h])) for h in before}
            self.check_view(store, want, exact=self.lossless_append)

        forall(st.tuples(cases(self._widths(store_factory)), st.integers(1, 4), SEEDS), check)

    def test_crop(self, store_factory) -> None:
        self.require(self.supports_crop, "supports_crop=False")

        def check(args):
            case, n, seed, frac = args
            store = self._written(store_factory, case)
            B, H, _, D = case[0].shape
            self._append(store, B, H, D, case[0].dtype, case[3], n, seed)
            before = entries(store.read())
            cut = round(frac * (max([int(p.max()) for p, *_ in before.values() if p.numel()] + [0]) + 1))
            store.crop(cut)
            self.check_view(store, {h: tuple(t[e[0] < cut] for t in e) for h, e in before.items()})
            kept = store.seq_lengths().clone()
            self._append(store, B, H, D, case[0].dtype, torch.full((B, 1), cut - 1), 2, seed + 7)
            assert torch.equal(store.seq_lengths(), kept + 2), "append after crop must add its entries"
            self.check_view(store)

        forall(st.tuples(cases(self._widths(store_factory)), st.integers(1, 3), SEEDS, st.floats(0, 1)), check)

    def test_reorder(self, store_factory) -> None:
        self.require(self.supports_reorder, "supports_reorder=False")

        def check(args):
            case, seed = args
            store = self._written(store_factory, case)
            B, H = case[0].shape[:2]
            before, lens = entries(store.read()), store.seq_lengths().clone()
            index = torch.randint(B, (B,), generator=torch.Generator().manual_seed(seed))
            store.reorder(index)
            assert torch.equal(store.seq_lengths(), lens[index]), "seq_lengths must follow the new batch order"
            self.check_view(store, {(i, h): before[int(index[i]), h] for i in range(B) for h in range(H)})

        forall(st.tuples(cases(self._widths(store_factory)), SEEDS), check)

    def test_reset_frees_memory(self, store_factory) -> None:
        def check(case):
            store = self._written(store_factory, case)
            store.reset()
            assert store.nbytes() == 0 == reachable_bytes(store), "reset() must free every tensor"
            with pytest.raises(ValueError):
                store.read()
            store.write(*case)
            self.check_view(store, expected(*case))

        forall(cases(self._widths(store_factory)), check, 8)

    def test_read_empty_store_raises(self, store_factory) -> None:
        with pytest.raises(ValueError):
            store_factory().read()

    def test_rejects_bad_input(self, store_factory) -> None:
        x, pos = torch.randn(2, 2, 6, 8), torch.arange(6).expand(2, 6)
        plan = Plan.from_keep(torch.ones(2, 2, 6, dtype=torch.bool))
        unsupported = [b for b in range(1, 16) if b not in store_factory().supported_bits]
        bad_tier = Plan(torch.full((2, 2, 6), unsupported[0] if unsupported else FULL, dtype=torch.uint8))
        one, p1 = torch.randn(2, 2, 1, 8), torch.full((2, 1), 6)
        cases = {  # (write the valid case first?, the call that must raise)
            "plan of another shape": (False, lambda s: s.write(x, x, Plan.from_keep(torch.ones(2, 2, 7, dtype=torch.bool)), pos)),
            "positions of another shape": (False, lambda s: s.write(x, x, plan, pos[:, :5])),
            "float positions": (False, lambda s: s.write(x, x, plan, pos.float())),
            "values of another shape": (False, lambda s: s.write(x, x[..., :4], plan, pos)),
            "values of another dtype": (False, lambda s: s.write(x, x.half(), plan, pos)),
            "integer keys": (False, lambda s: s.write(x.int(), x.int(), plan, pos)),
            "append with other heads": (True, lambda s: s.append(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8), p1)),
            "append with another dtype": (True, lambda s: s.append(one.half(), one.half(), p1)),
            "append with another head_dim": (True, lambda s: s.append(one[..., :4], one[..., :4], p1)),
            "append with positions of another shape": (True, lambda s: s.append(one, one, torch.full((2, 2), 6))),
        }
        if unsupported:
            cases[f"unsupported tier {unsupported[0]}"] = (False, lambda s: s.write(x, x, bad_tier, pos))
        for what, (setup, call) in cases.items():
            store = store_factory()
            if setup:
                store.write(x, x, plan, pos)
            with pytest.raises((ValueError, TypeError)):
                call(store)
                pytest.fail(f"no error for {what}")
