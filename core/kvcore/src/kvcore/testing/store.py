"""``StoreTests``: nothing is lost that the plan did not drop (the 16 tier bit-exact, quantized tiers within a
min-max bound), true positions in ascending order, ``-inf`` bias exactly on padding, attention over the view =
attention over the kept entries, ``nbytes`` = storage reachable from the store and nothing held for evicted
entries, append after compression, crop, reorder, reset, clear errors (bad input to every mutation raises
``ValueError``/``TypeError`` and changes nothing). Re-tiering (``tiers()`` / ``retier(plan)``):
``tiers()`` laid out like ``read()``; entries a new plan keeps at their tier are untouched (bit-identical), evicted
ones free their memory, demoted ones (``can_demote``) are within the bound of their new width; a bad plan raises
and changes nothing (all-or-nothing). With ``can_attend``, the fused ``attend(query, scale) -> (out, lse)`` equals
:func:`kvcore.reference_attention` over ``read(query)``.

Fixture ``store_factory`` (a callable making an empty store, e.g. ``return lambda: MyStore(page=16)``). Flags:
``quantized_bits`` (widths held besides 0 and 16; default ``supported_bits - {0, 16}``), ``quantized_key_bits`` /
``quantized_value_bits`` (default ``quantized_bits``; plans draw key and value tiers independently over the same
kept set), ``same_kv_tiers`` (values take the key tiers; default False), ``supports_crop``, ``supports_reorder``,
``lossless_full_tier`` (the 16 tier reads back bit-exact), ``lossless_append`` (appended entries read back
bit-exact, earlier ones unchanged); True by default. ``can_demote`` (plans drawn for ``retier`` move entries to
lower widths; default ``store.can_demote``), ``can_attend`` (test the fused ``attend``; default the store's
declaration, read through :func:`kvcore.attends` (``kvcore.AttendingStore``), skipped when False). Hook
``max_quantization_error(x, bits)`` bounds the error of one head's ``bits``-wide entries (default: uniform min-max
grouped along tokens or channels).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

from kvcore.attending import attends
from kvcore.attention import reference_attention
from kvcore.checks import value_checks
from kvcore.plan import EVICT, FULL, Plan
from kvcore.testing.base import StandardTests, forall, reachable_bytes
from kvcore.testing.strategies import SEEDS, dtypes, fill, left_padded_masks
from kvcore.view import KVView

SIZES = st.sampled_from((4, 8, 16))  # head dims


@st.composite
def cases(
    draw,
    widths: tuple[tuple[int, ...], tuple[int, ...] | None],
    min_keep: int = 0,
    kinds=("normal", "plateau", "huge"),
    empty_head: bool = False,
):
    """``(keys, values, plan, positions)``: a left-padded batch, a third of the real entries evicted, the others
    at ``FULL`` or a width of ``widths = (key widths, value widths or None for "same as the keys")``. With
    ``empty_head`` (and ``min_keep == 0``), some examples evict every entry of head ``(0, 0)``."""
    B, H, T, D = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 24)), draw(SIZES)
    dtype, kind, seed, valid = draw(dtypes()), draw(st.sampled_from(kinds)), draw(SEEDS), draw(left_padded_masks(B, T))
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(B, H, T, generator=g) > 1 / 3) & valid[:, None, :]
    if min_keep:
        keep[..., -1] |= keep.sum(-1) < min_keep
    elif empty_head and draw(st.booleans()):
        keep[0, 0] = False
    tier = [
        torch.tensor((FULL, FULL, *w), dtype=torch.uint8)[torch.randint(len(w) + 2, (B, H, T), generator=g)]
        for w in widths
        if w is not None
    ]
    kb, vb = (t.masked_fill(~keep, EVICT) for t in (tier[0], tier[-1]))
    positions = torch.where(valid, valid.long().cumsum(-1) - 1 + draw(st.integers(0, 5)), 0)
    keys, values = fill((B, H, T, D), dtype, kind, seed), fill((B, H, T, D), dtype, kind, seed + 1)
    return keys, values, Plan(kb, None if widths[1] is None else vb), positions


def entries(pos: torch.Tensor, *per_entry: torch.Tensor) -> dict:
    """``{(b, h): (positions, *per_entry)}`` of the entries with ``pos >= 0`` (``pos`` ``[B, H, T]``; each tensor of
    ``per_entry`` is ``[B, H, T, ...]``: keys, values, tiers, logit bias ...)."""
    return {
        (b, h): tuple(t[b, h][pos[b, h] >= 0] for t in (pos, *per_entry))
        for b in range(pos.shape[0])
        for h in range(pos.shape[1])
    }


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
    can_demote: bool | None = None
    can_attend: bool | None = None

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
                    self.assert_within_bound(head, g[wb == bits], w[wb == bits], bits)

    def assert_within_bound(self, head, got: torch.Tensor, want: torch.Tensor, bits: int) -> None:
        """``got`` (read back) is within :meth:`max_quantization_error` of ``want`` at ``bits``, with rounding slack
        of the dtype."""
        fi = torch.finfo(want.dtype)
        gf, wf, bound = got.float(), want.float(), self.max_quantization_error(want, bits)
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
        resident = store.resident_nbytes()
        assert isinstance(resident, int) and 0 <= resident <= store.nbytes(), (
            f"resident_nbytes() {resident!r} must be an int in [0, nbytes() = {store.nbytes()}]"
        )
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
        """``write`` then ``read``: exactly the kept entries with their true positions in ascending order, ``FULL``
        entries bit-exact, quantized entries within the min-max bound of their width, ``-inf`` bias exactly on padding,
        ``seq_lengths`` and ``nbytes`` consistent.

        Troubleshooting: positions must come from the ``positions`` argument (not the cache length); read each head's
        entries in position order; pad ragged heads with position -1, bias ``-inf`` and finite zeros. Declare the
        widths the store holds in ``supported_bits`` (or the ``quantized_*_bits`` flags) and override
        ``max_quantization_error`` for a non-min-max quantizer."""

        def check(case):
            self.check_view(self.written_store(store_factory, case), written(*case))

        forall(cases(self.widths(store_factory)), check)

    def test_attend_matches_reference(self, store_factory) -> None:
        """Attention over ``read()`` (``KVView.attend``) equals a naive per-head loop over the kept entries,
        for GQA groups 1/2/4.

        Troubleshooting: the view's padding is not masked (bias must be ``-inf`` there) or positions/entries are
        misaligned between keys and values."""

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
        """A layer written with ``k`` kept entries per head holds exactly as many bytes as one written with those
        ``k`` entries only, and rewriting frees the old content.

        Troubleshooting: gather the kept entries into new buffers (``keys[keep]``) instead of keeping the full tensor
        with a mask; drop references to the previous content in ``write``."""

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
        """Appending ``n`` entries after a compressed write adds ``n`` per head, after the kept ones, and (with
        ``lossless_append``) reads back everything bit-exact.

        Troubleshooting: append per head at each head's own length (heads are ragged after eviction); positions are
        the appended ones, not ``len(cache)``. A store that quantizes on append sets ``lossless_append = False``."""

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
        """``crop(p)`` drops every entry with position ``>= p`` (appended tokens rolled back) and appends work after.

        Troubleshooting: crop by true position, not by index (heads are ragged); set ``supports_crop = False`` if the
        store cannot roll back."""
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
        """``reorder(index)`` makes row ``i`` the old row ``index[i]`` (beam search), duplicates included.

        Troubleshooting: reorder every per-row structure (buffers, lengths, residuals, last positions) with the same
        index, and copy rows that appear twice; set ``supports_reorder = False`` if unsupported."""
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
        """``reset()`` frees every tensor (``nbytes() == 0`` and nothing reachable), ``read()`` then raises, and the
        store can be written again.

        Troubleshooting: set every buffer attribute to ``None`` (or re-run ``__init__`` state), including caches and
        scratch tensors."""

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
        """``read()`` on a store never written raises ``ValueError``.

        Troubleshooting: check for the empty state first; returning an empty view hides a missing ``write``."""
        with pytest.raises(ValueError):
            store_factory().read()

    def test_rejects_bad_input(self, store_factory) -> None:
        """Mismatched shapes/dtypes, float positions, integer keys, unsupported tiers and mismatched appends raise
        ``ValueError``/``TypeError``.

        Troubleshooting: validate keys/values/positions/plan with :mod:`kvcore.checks` against the stored
        ``[B, H, *, D]`` and dtype before writing; reject plan tiers outside ``supported_bits``."""
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

    def bad_input_calls(self, case, dtype: torch.dtype) -> dict[str, tuple[bool, object]]:
        """``{what: (must_raise, call(store))}`` of bad input for every mutation of a store written with ``case``
        (:meth:`bad_retier_setup`, positions ``0..7``) and then appended 3 entries (positions ``8..10``).
        ``must_raise=False`` marks input a store may accept (extreme finite values its quantizer cannot scale)."""
        x, v, plan, pos = case
        B, H, _, D = x.shape
        one = fill((B, H, 1, D), dtype, seed=11)
        two = fill((B, H, 2, D), dtype, seed=12)
        at = torch.full((B, 1), 11)

        def poked(t: torch.Tensor, value: float) -> torch.Tensor:
            t = t.clone()
            t[0, 0, 0, 0] = value  # entry 0 of head (0, 0) is kept by the plan; appended entries are all kept
            return t

        def with_pos(**cols) -> torch.Tensor:
            p = pos.clone()
            for col, value in cols.items():
                p[:, int(col[1:])] = value if not isinstance(value, str) else p[:, int(value[1:])]
            return p

        nan, inf, big = float("nan"), float("inf"), torch.finfo(dtype).max
        extreme = one.clone()
        extreme[..., 0::2], extreme[..., 1::2] = big, -big
        calls = {
            "write: NaN in a kept key": (True, lambda s: s.write(poked(x, nan), v, plan, pos)),
            "write: +inf in a kept value": (True, lambda s: s.write(x, poked(v, inf), plan, pos)),
            "write: -inf in a kept key": (True, lambda s: s.write(poked(x, -inf), v, plan, pos)),
            "write: a negative kept position": (True, lambda s: s.write(x, v, plan, with_pos(c0=-1))),
            "write: duplicated kept positions": (True, lambda s: s.write(x, v, plan, with_pos(c1="c0"))),
            "write: descending positions": (True, lambda s: s.write(x, v, plan, pos.flip(-1).contiguous())),
            "write: float positions": (True, lambda s: s.write(x, v, plan, pos.float())),
            "write: positions of another shape": (True, lambda s: s.write(x, v, plan, pos[:, :5])),
            "write: positions as a list": (True, lambda s: s.write(x, v, plan, pos.tolist())),
            "write: values of another shape": (True, lambda s: s.write(x, v[..., :4], plan, pos)),
            "write: keys of rank 3": (True, lambda s: s.write(x[0], v[0], plan, pos)),
            "write: a plan of another shape": (True, lambda s: s.write(x[:, :, :7], v[:, :, :7], plan, pos[:, :7])),
            "append: a NaN key": (True, lambda s: s.append(poked(one, nan), one, at)),
            "append: an inf value": (True, lambda s: s.append(one, poked(one, inf), at)),
            "append: a position already held": (True, lambda s: s.append(one, one, at - 1)),
            "append: a position before the held ones": (True, lambda s: s.append(one, one, at * 0)),
            "append: a negative position": (True, lambda s: s.append(one, one, at * 0 - 1)),
            "append: descending positions": (True, lambda s: s.append(two, two, torch.cat([at + 1, at], 1))),
            "append: duplicated positions": (True, lambda s: s.append(two, two, torch.cat([at, at], 1))),
            "append: float positions": (True, lambda s: s.append(one, one, at.float())),
            "append: positions of another shape": (True, lambda s: s.append(one, one, at[:1])),
            "append: another number of heads": (True, lambda s: s.append(one[:, :1], one[:, :1], at)),
            "append: another head dim": (True, lambda s: s.append(one[..., :4], one[..., :4], at)),
            "append: another dtype": (True, lambda s: s.append(one.double(), one.double(), at)),
            "append: values of another shape": (True, lambda s: s.append(one, two, at)),
            "append: extreme finite values": (False, lambda s: s.append(extreme, extreme, at)),
        }
        if self.supports_reorder:
            calls |= {
                "reorder: a float index": (True, lambda s: s.reorder(torch.tensor([0.0, 1.0]))),
                "reorder: an index out of range": (True, lambda s: s.reorder(torch.tensor([0, B]))),
                "reorder: a negative index": (True, lambda s: s.reorder(torch.tensor([-1, 0]))),
                "reorder: a bool index": (True, lambda s: s.reorder(torch.tensor([True, False]))),
                "reorder: a 2-D index": (True, lambda s: s.reorder(torch.tensor([[0, 1]]))),
                "reorder: a list": (True, lambda s: s.reorder([0, 1])),
            }
        if self.supports_crop:
            calls |= {
                "crop: a float": (True, lambda s: s.crop(4.5)),
                "crop: a str": (True, lambda s: s.crop("4")),
                "crop: None": (True, lambda s: s.crop(None)),
            }
        return calls

    def test_rejects_bad_input_atomically(self, store_factory) -> None:
        """Bad input to every mutation — NaN/inf keys or values on ``write`` and ``append``; negative, duplicated,
        descending, already-held or float positions; wrong shapes, ranks or dtypes; a float, bool, 2-D or
        out-of-range ``reorder`` index; ``crop`` with a float, str or ``None`` — raises ``ValueError`` or
        ``TypeError`` (any other exception fails, naming it), and the failed call leaves ``read()``,
        ``seq_lengths()`` and ``nbytes()`` exactly as they were (the store held quantized entries and residuals).

        Troubleshooting: validate every argument with :mod:`kvcore.checks` (``check_finite``, ``check_positions``,
        ``check_integer_tensor``, ``check_int``) before touching any buffer, so a bad index never reaches a gather
        (``IndexError``) and bad data never reaches a quantizer; do not ``reset()`` at the top of ``write``; build
        the new state in locals (or on copies of the parts) and assign it in the last step, so a step that fails
        late (a quantizer refusing a range) leaves the old state in place. A store that can legitimately hold
        non-finite data must say so in its documentation and its suite, not silently accept it."""
        with value_checks(True):  # on an accelerator the per-step value checks are otherwise skipped
            self._rejects_bad_input_atomically(store_factory)

    def _rejects_bad_input_atomically(self, store_factory) -> None:
        for dtype in (torch.float32, torch.float16):
            case = self.bad_retier_setup(store_factory, dtype)
            x = case[0]
            B = x.shape[0]

            def fresh():
                store = self.written_store(store_factory, case)
                self.append(store, x, torch.full((B,), 7), 3, seed=5)
                return store

            for what, (must_raise, call) in self.bad_input_calls(case, dtype).items():
                store = fresh()
                v0 = store.read()
                snap = [t.clone() for t in (v0.keys, v0.values, v0.positions, v0.logit_bias, store.seq_lengths())]
                size = store.nbytes()
                try:
                    call(store)
                except (ValueError, TypeError):
                    pass
                except Exception as e:
                    raise AssertionError(
                        f"{dtype} {what}: raised {type(e).__name__} ({e}); bad input must raise ValueError or "
                        "TypeError naming the argument and what is allowed"
                    ) from e
                else:
                    if must_raise:
                        raise AssertionError(f"{dtype} {what}: accepted (must raise ValueError or TypeError)")
                    continue
                try:
                    v1 = store.read()
                except Exception as e:
                    raise AssertionError(
                        f"{dtype} {what}: raised but left the store unreadable: read() raised {type(e).__name__} ({e})"
                    ) from e
                now = (v1.keys, v1.values, v1.positions, v1.logit_bias, store.seq_lengths())
                for name, a, b in zip(("keys", "values", "positions", "logit_bias", "seq_lengths"), snap, now):
                    assert a.shape == b.shape and torch.equal(a, b), f"{dtype} {what}: raised but changed {name}"
                assert store.nbytes() == size, f"{dtype} {what}: raised but changed nbytes() {size} -> {store.nbytes()}"

    # -- capabilities ------------------------------------------------------------------------------------
    def test_declares_capabilities(self, store_factory) -> None:
        """The store declares its capabilities as the protocol's class attributes: ``supported_bits`` (a frozenset
        holding ``EVICT`` and ``FULL``), ``query_dependent``, ``can_attend``, ``can_demote`` (bools); with
        ``can_attend`` it implements :class:`kvcore.AttendingStore` (an ``attend`` method; :func:`kvcore.attends`).

        Troubleshooting: subclass ``kvcore.Store`` to inherit the defaults and override only what the store
        offers (``can_attend = True`` needs ``def attend(self, query, scale=None)``); ``supported_bits`` must be a
        ``frozenset`` of ints that includes 0 (evict) and 16 (full precision)."""
        store = store_factory()
        bits = store.supported_bits
        assert isinstance(bits, frozenset) and all(isinstance(b, int) for b in bits), "supported_bits: frozenset[int]"
        assert {EVICT, FULL} <= bits, f"supported_bits {sorted(bits)} must hold EVICT=0 and FULL=16"
        for name in ("query_dependent", "can_attend", "can_demote"):
            assert isinstance(getattr(type(store), name), bool), f"{name} must be declared as a bool class attribute"
        attends(store)  # TypeError: can_attend = True without attend()

    # -- re-tiering ----------------------------------------------------------------------------------------
    def held_entries(self, store) -> tuple[KVView, Plan, dict]:
        """``read()``, ``tiers()`` and ``{(b, h): (positions, keys, values, key tiers, value tiers)}``, after
        checking that ``tiers()`` is laid out like ``read()`` and marks exactly the held entries."""
        view, t = store.read(), store.tiers()
        assert isinstance(t, Plan), f"tiers() must return a kvcore.Plan, got {type(t).__name__}"
        assert tuple(t.key_bits.shape) == tuple(view.positions.shape), (
            f"tiers() {tuple(t.key_bits.shape)} must be laid out like read() {tuple(view.positions.shape)}"
        )
        pad = (view.positions < 0).to(t.key_bits.device)
        for name, bits in (("key", t.key_bits), ("value", t.bits_for_values)):
            assert torch.equal(bits == EVICT, pad), f"tiers(): {name} tiers must be EVICT exactly on read()'s padding"
            held = set(bits[~pad].tolist())
            assert held <= set(store.supported_bits) - {EVICT}, f"tiers() holds {name} tiers {sorted(held)}"
        return view, t, entries(view.positions, view.keys, view.values, t.key_bits.cpu(), t.bits_for_values.cpu())

    def demotion_widths(self, store_factory) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Quantized widths keys and values may be demoted to (the suite's key / value widths)."""
        keys, values = self.widths(store_factory)
        return tuple(keys), tuple(keys if values is None else values)

    def draw_retier(self, store_factory, t: Plan, seed: int, evict: float = 1 / 3) -> Plan:
        """A new plan from the held tiers ``t``: each held entry evicted (keys and values together) with
        probability ``evict``, else kept at its tier or, if the store can demote, sometimes moved to a lower
        quantized width (keys and values independently unless ``same_kv_tiers``)."""
        g = torch.Generator().manual_seed(seed)
        held = t.keep_keys.cpu()
        gone = (torch.rand(held.shape, generator=g) < evict) & held
        kb, vb = t.key_bits.cpu().clone(), t.bits_for_values.cpu().clone()
        if self.flag("can_demote", store_factory().can_demote):
            kw, vw = self.demotion_widths(store_factory)
            for bits, widths in ((kb, kw), (vb, vw)) if not self.same_kv_tiers else ((kb, kw),):
                old = bits.clone()
                for w in sorted(widths, reverse=True):  # a later (lower) pick overrides a higher one
                    pick = held & ~gone & (old > w) & (torch.rand(held.shape, generator=g) < 0.3)
                    bits[pick] = w
        kb[gone] = EVICT
        vb[gone] = EVICT
        if self.same_kv_tiers:
            return Plan(kb.to(t.key_bits.device))
        return Plan(kb.to(t.key_bits.device), vb.to(t.key_bits.device))

    def check_retiered(self, store, before: dict, view: KVView, plan: Plan) -> None:
        """After ``retier(plan)`` of a store that held ``before`` (read as ``view``): kept entries at their tier are
        bit-identical, demoted ones within the bound of their new width (from the held data), evicted ones gone,
        ``tiers()`` is the plan's, ``seq_lengths`` match, ``nbytes`` = bytes reachable."""
        _, _, after = self.held_entries(store)
        assert after.keys() == before.keys()
        for (b, h), (p, k, v, kt, vt) in before.items():
            m = view.positions[b, h] >= 0
            nk, nv = plan.key_bits[b, h].cpu()[m], plan.bits_for_values[b, h].cpu()[m]
            keep = nk != EVICT
            ap, ak, av, akt, avt = after[b, h]
            assert torch.equal(ap, p[keep]), f"head {(b, h)}: positions {ap.tolist()}, want {p[keep].tolist()}"
            assert torch.equal(akt, nk[keep]) and torch.equal(avt, nv[keep]), f"head {(b, h)}: tiers() != the plan"
            for got, held, old, new, what in (
                (ak, k[keep], kt[keep], nk[keep], "keys"),
                (av, v[keep], vt[keep], nv[keep], "values"),
            ):
                same = old == new
                assert torch.equal(got[same], held[same]), f"head {(b, h)}: untouched {what} changed by retier"
                for bits in set(new[~same].tolist()):
                    self.assert_within_bound((b, h), got[new == bits], held[new == bits], bits)
        assert torch.equal(store.seq_lengths().cpu(), plan.keep_keys.sum(-1).cpu()), "seq_lengths != entries kept"
        self.check_view(store)

    def test_tiers_follow_write_and_append(self, store_factory) -> None:
        """``tiers()`` is laid out like ``read()`` and gives every held entry its planned tier after ``write``;
        after ``append`` earlier entries keep their tiers and new ones are ``FULL`` (with ``lossless_append``;
        otherwise tiers only move down and new entries are ``FULL`` or a quantized width), and every entry reads back
        as its reported tier promises (``FULL`` bit-exact, a width within its bound).

        Troubleshooting: ``tiers()`` must list entries in ``read()``'s order (per head, ascending positions, padding
        last) with ``EVICT`` on padding; a store that quantizes on append (a residual) must report the tier it
        really holds, and set ``lossless_append = False``."""

        def check(args):
            case, n, seed = args
            store = self.written_store(store_factory, case)
            _, _, got = self.held_entries(store)
            want = written(*case)
            for head, (p, _, _, kt, vt) in got.items():
                wp, _, _, wkt, wvt = want[head]
                assert torch.equal(p, wp.long()), f"head {head}: positions {p.tolist()}, wrote {wp.tolist()}"
                assert torch.equal(kt, wkt) and torch.equal(vt, wvt), f"head {head}: tiers() differ from the plan"
            new = self.append(store, case[0], case[3].max(-1).values, n, seed)
            _, _, after = self.held_entries(store)
            for head, (p, k, v, kt, vt) in after.items():
                old = len(got[head][0])
                assert torch.equal(p, torch.cat([got[head][0], new[head][0]])), f"head {head}: positions after append"
                for t, t0 in ((kt, got[head][3]), (vt, got[head][4])):
                    if self.lossless_append:
                        assert torch.equal(t[:old], t0), f"head {head}: append changed earlier tiers"
                        assert bool((t[old:] == FULL).all()), f"head {head}: appended entries must be FULL"
                    else:
                        assert bool((t[:old] <= t0).all()), f"head {head}: append moved an entry up"
                wk = torch.cat([want[head][1], new[head][1]])
                wv = torch.cat([want[head][2], new[head][2]])
                self.assert_entries({head: (p, k, v)}, {head: (p, wk, wv, kt, vt)})

        forall(st.tuples(cases(self.widths(store_factory)), st.integers(1, 4), SEEDS), check)

    def test_retier_keeps_untouched_entries(self, store_factory) -> None:
        """``retier(plan)`` with a plan drawn from ``tiers()`` (each entry kept at its tier, evicted, or — with
        ``can_demote`` — moved to a lower quantized width): kept entries read back bit-identical (keys, values,
        positions), evicted ones are gone, demoted ones are within the bound of their new width of the held data,
        ``tiers()`` is the new plan, ``seq_lengths`` match and ``nbytes()`` falls and equals the bytes reachable.

        Troubleshooting: re-tiering must not dequantize and re-quantize what it keeps — copy kept codes and
        metadata as they are; free evicted entries (rebuild buffers, do not keep the old ones alive); a demotion is
        transcoded from the held codes (e.g. 4 -> 2 bits by rescaling the codes), never from a full-precision copy
        the store should not have."""

        def check(args):
            case, seed, evict = args
            store = self.written_store(store_factory, case)
            view, t, before = self.held_entries(store)
            size = store.nbytes()
            plan = self.draw_retier(store_factory, t, seed, evict)
            store.retier(plan)
            self.check_retiered(store, before, view, plan)
            evicted = bool((t.keep_keys.cpu() & ~plan.keep_keys.cpu()).any())
            demoted = bool((plan.keep_keys.cpu() & (plan.key_bits.cpu() != t.key_bits.cpu())).any()) or bool(
                (plan.keep_values.cpu() & (plan.bits_for_values.cpu() != t.bits_for_values.cpu())).any()
            )
            if not demoted:  # a demotion may add metadata (scales) worth more than the bits it saves on tiny heads
                if evicted:
                    assert store.nbytes() < size, f"retier evicted entries but nbytes() went {size} -> {store.nbytes()}"
                assert store.nbytes() <= size, f"retier grew nbytes() {size} -> {store.nbytes()}"

        forall(st.tuples(cases(self.widths(store_factory)), SEEDS, st.sampled_from((0.0, 1 / 3, 1.0))), check)

    def test_retier_identity_is_noop(self, store_factory) -> None:
        """``retier(tiers())`` changes nothing: ``read()`` (keys, values, positions, bias) and ``tiers()`` are
        bit-identical, before and after appends; ``nbytes()`` does not grow.

        Troubleshooting: a store that rebuilds its buffers on retier must copy the held representation as it is;
        compare tiers to the held ones, not to a recomputed plan."""

        def check(args):
            case, n, seed = args
            store = self.written_store(store_factory, case)
            if n:
                self.append(store, case[0], case[3].max(-1).values, n, seed)
            v0, t0, size = store.read(), store.tiers(), store.nbytes()
            snap = [
                x.clone() for x in (v0.keys, v0.values, v0.positions, v0.logit_bias, t0.key_bits, t0.bits_for_values)
            ]
            store.retier(t0)
            v1, t1 = store.read(), store.tiers()
            now = (v1.keys, v1.values, v1.positions, v1.logit_bias, t1.key_bits, t1.bits_for_values)
            names = ("keys", "values", "positions", "logit_bias", "key tiers", "value tiers")
            for name, a, b in zip(names, snap, now):
                assert a.shape == b.shape and torch.equal(a, b), f"retier(tiers()) changed {name}"
            assert store.nbytes() <= size, f"retier(tiers()) grew nbytes() {size} -> {store.nbytes()}"
            self.check_view(store)

        forall(st.tuples(cases(self.widths(store_factory)), st.integers(0, 3), SEEDS), check, 10)

    def test_retier_evicted_entries_hold_no_memory(self, store_factory) -> None:
        """Evicting by ``retier`` frees as much as evicting by ``write``: a full-precision layer re-tiered to ``k``
        entries per head holds exactly the bytes of a layer written with ``k`` entries per head.

        Troubleshooting: rebuild (or slice-and-clone) the buffers so the evicted rows' storage is released; a view
        into the old buffer keeps all of it alive (``nbytes`` counts storages, as :func:`kvcore.reachable_bytes`)."""

        def check(args):
            B, H, D, k, seed = args
            T = 32
            x = fill((B, H, T, D), seed=seed)
            pos = torch.arange(T).expand(B, T)
            ones = torch.ones(B, H, T, dtype=torch.bool)
            store = self.written_store(store_factory, (x, x, Plan.from_keep(ones), pos))
            keep = torch.rand(B, H, T, generator=torch.Generator().manual_seed(seed)).argsort(-1).argsort(-1) < k
            store.retier(Plan.from_keep(keep))
            prefix = self.written_store(
                store_factory, (x[:, :, :k], x[:, :, :k], Plan.from_keep(ones[..., :k]), pos[:, :k])
            )
            assert store.nbytes() == prefix.nbytes(), (
                f"{k} entries per head hold {store.nbytes()} bytes after retier, {prefix.nbytes()} when written"
            )
            assert store.nbytes() == reachable_bytes(store), "nbytes() != bytes of the tensors the store holds"

        forall(st.tuples(st.integers(1, 2), st.integers(1, 3), SIZES, st.integers(1, 24), SEEDS), check, 10)

    def test_append_after_retier(self, store_factory) -> None:
        """Appending after a retier adds the new entries after the kept ones (positions, ``seq_lengths``) and
        leaves the kept ones as they were (with ``lossless_append``).

        Troubleshooting: retier must leave the store's bookkeeping (per-head lengths, capacities, residuals, last
        positions) consistent with what it kept."""

        def check(args):
            case, seed, n = args
            store = self.written_store(store_factory, case)
            store.retier(self.draw_retier(store_factory, store.tiers(), seed))
            v, lens = store.read(), store.seq_lengths().clone()
            before = entries(v.positions, v.keys, v.values)
            new = self.append(store, case[0], case[3].max(-1).values, n, seed + 3)
            assert torch.equal(store.seq_lengths(), lens + n), "append after retier must add n entries per head"
            want = {h: tuple(torch.cat(p) for p in zip(before[h], new[h])) for h in before}
            self.check_view(store, want, self.lossless_append)
            self.held_entries(store)

        forall(st.tuples(cases(self.widths(store_factory)), SEEDS, st.integers(1, 3)), check, 10)

    def bad_retier_setup(self, store_factory, dtype: torch.dtype):
        """A written layer with ragged heads (head ``(0, 0)`` keeps 3 entries, the others 6) over the suite's
        widths, for the bad-plan test."""
        B, H, T, D = 2, 2, 8, 8
        x = fill((B, H, T, D), dtype, seed=3)
        pos = torch.arange(T).expand(B, T)
        kw, vw = self.demotion_widths(store_factory)
        kcycle = torch.tensor((FULL, *kw, FULL), dtype=torch.uint8)
        vcycle = kcycle if self.same_kv_tiers else torch.tensor((FULL, *vw, FULL), dtype=torch.uint8)
        idx = torch.arange(T)
        kb = kcycle[idx % len(kcycle)].expand(B, H, T).clone()
        vb = vcycle[idx % len(vcycle)].expand(B, H, T).clone()
        keep = (idx < 6).expand(B, H, T).clone()
        keep[0, 0, 3:] = False
        kb[~keep], vb[~keep] = EVICT, EVICT
        plan = Plan(kb) if self.same_kv_tiers else Plan(kb, vb)
        return (x, x.flip(-1).contiguous(), plan, pos)

    def bad_retier_plans(self, store_factory, t: Plan) -> dict[str, object]:
        """``{what: plan}`` of plans ``retier`` must refuse, built from the held tiers ``t`` of
        :meth:`bad_retier_setup`'s layer. Each plan also evicts a valid entry (head ``(1, 1)``'s first)."""
        can_demote = self.flag("can_demote", store_factory().can_demote)
        odd = [b for b in range(1, 16) if b not in store_factory().supported_bits]
        low = [w for w in self.demotion_widths(store_factory)[0] if w != FULL]
        kb, vb = t.key_bits.cpu(), t.bits_for_values.cpu()
        held = kb != EVICT
        spared = torch.tensor([1, 1, 0])

        def first_held(cond: torch.Tensor) -> tuple[int, ...] | None:
            hit = (held & cond).nonzero()
            hit = hit[(hit != spared).any(-1)]
            return None if len(hit) == 0 else tuple(hit[0].tolist())

        def plan_with(at: tuple[int, ...] | None, key_tier: int, value_tier: int | None = None) -> Plan | None:
            if at is None:
                return None
            k, v = kb.clone(), vb.clone()
            k[tuple(spared.tolist())] = EVICT  # a valid eviction: nothing may happen to it
            v[tuple(spared.tolist())] = EVICT
            k[at] = key_tier
            if value_tier is not None:
                v[at] = value_tier
            return Plan(k) if self.same_kv_tiers else Plan(k, v)

        pad = (~held).nonzero()
        bad = {
            "moves an entry up": plan_with(first_held(kb < FULL), FULL),
            "an unsupported width": plan_with(first_held(held), odd[0]) if odd else None,
            "demotes without can_demote": None
            if can_demote or not low
            else plan_with(first_held(kb > min(low)), min(low)),
            "keeps padding": plan_with(tuple(pad[0].tolist()) if len(pad) else None, FULL, FULL),
            "a plan one entry longer": Plan(torch.cat([kb, torch.full_like(kb[..., :1], FULL)], -1)),
            "a plan of another batch": Plan(torch.cat([kb, kb[:1]])),
            "a tensor instead of a Plan": kb.clone(),
        }
        return {what: plan for what, plan in bad.items() if plan is not None}

    def test_retier_rejects_bad_plans_atomically(self, store_factory) -> None:
        """A plan that moves an entry up, uses a width the store does not hold, demotes without ``can_demote``,
        keeps padding, or has the wrong shape/type raises ``ValueError``/``TypeError`` — and leaves ``read()``,
        ``tiers()`` and ``nbytes()`` exactly as they were, even though the plan also evicts a valid entry.

        Troubleshooting: validate the whole plan before touching anything (compute the new buffers first, assign
        them last); compare every entry's new tier with ``tiers()``: only ``EVICT``, the held tier, or (with
        ``can_demote``) a lower supported quantized width are allowed."""
        for dtype in (torch.float32, torch.bfloat16):
            case = self.bad_retier_setup(store_factory, dtype)
            bad = self.bad_retier_plans(store_factory, self.written_store(store_factory, case).tiers())
            for what, plan in bad.items():
                store = self.written_store(store_factory, case)
                v0, t0, size = store.read(), store.tiers(), store.nbytes()
                snap = [
                    x.clone()
                    for x in (
                        v0.keys,
                        v0.values,
                        v0.positions,
                        v0.logit_bias,
                        t0.key_bits,
                        t0.bits_for_values,
                        store.seq_lengths(),
                    )
                ]
                with pytest.raises((ValueError, TypeError)):
                    store.retier(plan)
                    pytest.fail(f"retier accepted {what}")
                v1, t1 = store.read(), store.tiers()
                now = (
                    v1.keys,
                    v1.values,
                    v1.positions,
                    v1.logit_bias,
                    t1.key_bits,
                    t1.bits_for_values,
                    store.seq_lengths(),
                )
                for name, a, b in zip(
                    ("keys", "values", "positions", "bias", "key tiers", "value tiers", "lengths"), snap, now
                ):
                    assert a.shape == b.shape and torch.equal(a, b), f"retier with {what} raised but changed {name}"
                assert store.nbytes() == size, f"retier with {what} raised but changed nbytes()"

    # -- fused attention -----------------------------------------------------------------------------------
    def test_attend_fused_matches_reference(self, store_factory) -> None:
        """With ``can_attend``: ``store.attend(q, scale)`` returns ``(out [B, Hq, Q, D], lse [B, Hq, Q])`` equal (fp32
        tolerance) to :func:`kvcore.reference_attention` over ``store.read(q)`` — GQA groups 1/2/4, 1 to 3 queries,
        ragged heads, and heads with no entry (``lse = -inf``, ``out = 0``).

        Troubleshooting: add the view's logit bias (``-inf`` on padding) before the softmax; map query head ``j`` to
        KV head ``j // group``; return the natural-log log-sum-exp; a head with no entry must give ``out = 0`` and
        ``lse = -inf``, not NaN; ``scale=None`` means ``1/sqrt(D)``."""
        self.require(self.flag("can_attend", attends(store_factory())), "can_attend=False")

        def check(args):
            case, group, nq, seed, scale, qdtype = args
            store = self.written_store(store_factory, case)
            B, H, _, D = case[0].shape
            q = fill((B, H * group, nq, D), case[0].dtype if qdtype is None else qdtype, seed=seed)
            out, lse = store.attend(q, scale)
            want_out, want_lse = reference_attention(store.read(q), q, scale)
            assert tuple(out.shape) == (B, H * group, nq, D) and tuple(lse.shape) == (B, H * group, nq), (
                f"attend gave out {tuple(out.shape)}, lse {tuple(lse.shape)}"
            )
            torch.testing.assert_close(lse.float(), want_lse, rtol=1e-4, atol=1e-4, msg="attend: lse != reference")
            torch.testing.assert_close(out.float(), want_out, rtol=1e-4, atol=1e-4, msg="attend: out != reference")

        cs = cases(self.widths(store_factory), kinds=("normal", "plateau"), empty_head=True)
        scales = st.none() | st.floats(0.05, 2.0)
        qdt = st.sampled_from((None, torch.float32))
        forall(st.tuples(cs, st.sampled_from((1, 2, 4)), st.integers(1, 3), SEEDS, scales, qdt), check)

    def test_attend_rejects_bad_queries(self, store_factory) -> None:
        """With ``can_attend``: queries of another head dim or batch, ``Hq`` not a multiple of ``Hkv``, an integer
        dtype, a rank other than 4, or a non-positive scale raise ``ValueError``/``TypeError``.

        Troubleshooting: validate as :func:`kvcore.attention.check_query` / ``check_scale`` do, before launching a
        kernel (a kernel reads out of bounds instead of raising)."""
        self.require(self.flag("can_attend", attends(store_factory())), "can_attend=False")
        B, H, T, D = 2, 2, 6, 8
        x = fill((B, H, T, D), seed=1)
        store = self.written_store(
            store_factory, (x, x, Plan.from_keep(torch.ones(B, H, T, dtype=torch.bool)), torch.arange(T).expand(B, T))
        )
        q = fill((B, 2 * H, 1, D), seed=2)
        bad = {
            "another head dim": (q[..., :4], None),
            "another batch": (q[:1], None),
            "Hq not a multiple of Hkv": (q[:, :3], None),
            "integer queries": (q.int(), None),
            "rank 3": (q[:, :, 0], None),
            "scale 0": (q, 0.0),
            "negative scale": (q, -1.0),
        }
        for what, (query, scale) in bad.items():
            with pytest.raises((ValueError, TypeError)):
                store.attend(query, scale)
                pytest.fail(f"attend accepted {what}")
