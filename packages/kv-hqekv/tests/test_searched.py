"""Shares searched for the offline models and shipped with kv-hqekv (``kv_hqekv.searched``)."""

import pytest

from kv_hqekv import search_settings, searched, searched_names
from kv_hqekv.registry import METHODS
from kv_hqekv.searched import SEARCHED_DIR
from kvcore import Budget


def test_searched_shares_ship_for_smollm2_and_meet_their_bits():
    """Invariant: every shipped result is a feasible share vector at the bits it was searched for (Eq. 3), with the
    settings that trace it to a ``kv-hqekv search`` command; SmolLM2 has one at 2 bits."""
    names = searched_names()
    assert "smollm2-2" in names
    for name in names:
        settings = search_settings(name)
        for key in ("bits", "trials", "seed", "model", "context", "continuation", "calibration"):
            assert key in settings, (name, key)
        shares = searched(name)
        assert shares.avg_bits == pytest.approx(settings["bits"], abs=5e-3), name
        assert min(shares.as_tuple()) >= 0 and sum(shares.as_tuple()) == pytest.approx(1.0, abs=5e-3)
        assert name == f"{settings['model'].split('-')[0]}-{settings['bits']:g}"  # the file names its model and bits


def test_each_searched_result_is_a_registered_method_at_its_bits():
    """Invariant: ``hqekv-<name>`` builds HqeKV with exactly the shipped shares at the searched bits."""
    by_name = {m.name: m for m in METHODS}
    for name in searched_names():
        method = by_name[f"hqekv-{name}"]
        bits = search_settings(name)["bits"]
        assert method.default == Budget(avg_bits=bits)
        comp = method.build()
        assert comp.name == f"hqekv-{name}" and comp.selector.shares == searched(name)


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="smollm2-2"):
        searched("no-such-model-2")
    with pytest.raises(TypeError, match="name must be a str"):
        searched(2)
    assert SEARCHED_DIR.is_dir()
