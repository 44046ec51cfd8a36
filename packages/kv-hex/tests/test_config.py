"""HEXConfig: the paper's defaults and clear errors for bad values."""

import math

import pytest

from kv_hex import HEXConfig


def test_paper_defaults():
    c = HEXConfig()
    assert (c.bits, c.rho, c.heavy_ratio, c.recent, c.block_size, c.mode) == (3, 0.03125, 0.02, 8, 96, "append")
    assert (c.mask_scope, c.value_scope, c.mask_kind, c.masked_stats) == ("layer", "layer", "expander", True)
    assert c.heavy_count(96) == 1 and c.heavy_count(192) == 3  # int(0.02 n): spec A4


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("bits", 5, "bits must be one of"),
        ("bits", 16, "bits must be one of"),
        ("rho", 0.0, "rho must lie"),
        ("rho", 1.0, "rho must lie"),
        ("rho", math.nan, "rho must be finite"),
        ("heavy_ratio", 1.0, "heavy_ratio must lie"),
        ("heavy_ratio", -0.1, "heavy_ratio must lie"),
        ("recent", -1, "recent must be an int >= 0"),
        ("block_size", 0, "block_size must be an int >= 1"),
        ("mode", "hybrid", "mode must be one of"),
        ("mask_scope", "token", "mask_scope must be one of"),
        ("value_scope", "channel", "value_scope must be one of"),
        ("mask_kind", "lps", "mask_kind must be one of"),
        ("seed", -3, "seed must be an int >= 0"),
    ],
)
def test_bad_values_raise_value_error(field, value, match):
    with pytest.raises(ValueError, match=match):
        HEXConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("bits", 3.0), ("bits", True), ("rho", "0.1"), ("recent", 2.5), ("block_size", None), ("masked_stats", 1)],
)
def test_bad_types_raise_type_error(field, value):
    with pytest.raises(TypeError, match=field):
        HEXConfig(**{field: value})
