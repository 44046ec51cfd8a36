"""kv_hf.testing.tiny_model: deterministic from its seed, configurable, every supported family."""

import pytest
import torch

from kv_hf.testing import FAMILIES, tiny_model


def test_same_seed_same_weights_and_overrides_apply():
    a, b, c = tiny_model(seed=3), tiny_model(seed=3), tiny_model(seed=4)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    m = tiny_model(head_dim=32, num_hidden_layers=1)
    assert m.config.head_dim == 32 and m.config.num_hidden_layers == 1 and not m.training


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_runs(family):
    out = tiny_model(family)(torch.randint(3, 256, (1, 5)))
    assert out.logits.shape == (1, 5, 256) and bool(torch.isfinite(out.logits).all())


def test_unknown_family():
    with pytest.raises(ValueError, match="family must be one of"):
        tiny_model("gpt2")
