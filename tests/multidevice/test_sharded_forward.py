"""Sharded forward on 8 fake CPU devices equals the single-device forward."""
import jax
import numpy as np
import pytest

import c2jax
from c2jax.config import default_config
from c2jax.models import param_shardings
from c2jax.parallel import activate, data_sharding, make_mesh


@pytest.mark.parametrize("attention,shape", [("gqa", (2, 2, 1, 2)), ("mla", (1, 4, 1, 2))])
def test_sharded_forward_matches_single_device(attention, shape):
    assert jax.device_count() == 8
    cfg = default_config()
    cfg.model.attention = attention
    cfg.model.moe_dispatch = "dropless"
    cfg.mesh.shape = shape
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.model.vocab_size)
    ref = c2jax.models.forward(cfg, params, tokens)
    mesh = make_mesh(cfg)
    shardings = param_shardings(cfg, mesh)
    sharded = jax.device_put(params, shardings)
    assert any(len(s.spec) and any(a is not None for a in s.spec) for s in jax.tree.leaves(shardings))
    with activate(cfg, mesh):
        toks = jax.device_put(tokens, data_sharding(cfg, mesh))
        out = jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t))(sharded, toks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
