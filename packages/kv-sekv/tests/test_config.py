"""SEKVConfig: the paper's defaults (§4.1, App. A, Table 7) and clear errors."""

import pytest

from kv_sekv import SEKVConfig


def test_defaults_are_the_papers():
    c = SEKVConfig()
    assert (c.alpha, c.min_span, c.max_rank, c.proj_dim, c.window) == (1.0, 16, 32, 32, 512)
    assert (c.tau_init, c.lambda_zoom, c.lambda_recon, c.lambda_budget) == (0.05, 1.0, 0.5, 0.1)
    assert (c.beta, c.pos_weight, c.rho, c.budget) == (0.1, 10.0, 0.9, 0.1)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("alpha", 0.0, ValueError),
        ("alpha", -1.0, ValueError),
        ("alpha", float("nan"), ValueError),
        ("alpha", "1", TypeError),
        ("budget", 0.0, ValueError),
        ("budget", 1.5, ValueError),
        ("min_span", 0, ValueError),
        ("min_span", 2.0, TypeError),
        ("max_rank", True, TypeError),
        ("window", -1, ValueError),
        ("tau_init", 1.0, ValueError),
        ("rho", 0.0, ValueError),
        ("pos_weight", 0.0, ValueError),
        ("lambda_budget", -0.1, ValueError),
    ],
)
def test_bad_values_name_the_field(field, value, error):
    with pytest.raises(error, match=field):
        SEKVConfig(**{field: value})


def test_budget_one_is_allowed():
    assert SEKVConfig(budget=1.0).budget == 1.0
