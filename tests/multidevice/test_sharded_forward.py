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


@pytest.mark.parametrize("quant", ["mxfp8", "int8"])
def test_prequantized_experts_under_expert_parallelism_match_single_device(quant):
    """The sampler's pre-quantized expert storage (QuantizedExperts: values, block or channel scales)
    through the EP shard_map, expert weights FSDP-sharded over fsdp and gathered inside it, equals
    the same mesh's forward on float weights quantized on the fly (and, for MXFP8, whose token
    all-to-all is exact, the single-device forward; int8 rows travel as MXFP8 under EP)."""
    from c2jax.sampling.quantized import quantize_params, quantized_shardings
    cfg = default_config()
    cfg.model.moe_dispatch = "dropless"
    cfg.model.quant = quant
    cfg.mesh.shape = (2, 2, 1, 2)
    cfg.mesh.rules = tuple((n, {"experts": ("data", "expert"), "expert_embed": "fsdp"}.get(n, t))
                           for n, t in cfg.mesh.rules)
    floats = c2jax.models.init_params(cfg, jax.random.key(0))
    params = quantize_params(floats, quant, "experts")
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.model.vocab_size)
    mesh = make_mesh(cfg)
    float_shardings = param_shardings(cfg, mesh)
    sharded = jax.device_put(params, quantized_shardings(params, float_shardings, mesh))
    w = sharded.prepared["moe_layers"]["block"]["moe"]["w_gate"]
    assert len(w.values_GKN.sharding.device_set) == 8 and w.values_GKN.sharding.spec[2] == "fsdp"
    fwd = jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t))
    with activate(cfg, mesh):
        toks = jax.device_put(tokens, data_sharding(cfg, mesh))
        out = fwd(sharded, toks)
        on_the_fly = fwd(jax.device_put(floats, float_shardings), toks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(on_the_fly), atol=1e-5, rtol=1e-5)
    if quant == "mxfp8":
        ref = c2jax.models.forward(cfg, params, tokens)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
