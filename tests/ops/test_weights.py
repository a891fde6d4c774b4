"""Weights stored prepared (c2jax.ops.weights): separate() puts every non-array weight at its
path in the prepared collection and keeps the structure on both sides; a layer reads a weight
from that collection in place of the param, and the forward over Weights equals the float
forward on the same values."""
import jax
import jax.numpy as jnp
import numpy as np

import c2jax
import pallas_kernels as pk
from c2jax.models.layers import Linear
from c2jax.ops.weights import Weights, separate, variables


def test_separate_keeps_paths_and_structure():
    rng = np.random.default_rng(0)
    a, b = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    experts = ((a, a.T), (a, a.T))                    # per-expert buffers: a tuple, prepared
    q = pk.quantize_weight(jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), "int8")
    tree = {"embed": a, "layers": [{"mlp": {"kernel": q, "bias": b}}, {"moe": {"experts": experts, "router": a}}]}
    w = separate(tree)
    assert w.params == {"embed": a, "layers": [{"mlp": {"bias": b}}, {"moe": {"router": a}}]}
    assert w.prepared["layers"][0]["mlp"]["kernel"] is q and w.prepared["layers"][1]["moe"]["experts"] is experts
    assert "embed" not in w.prepared and "embed" in w.params
    leaves, treedef = jax.tree.flatten(w)
    assert len(leaves) == len(jax.tree.leaves(tree)) and isinstance(jax.tree.unflatten(treedef, leaves), Weights)


def test_layer_reads_the_prepared_weight_not_a_param():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    q = pk.quantize_weight(w, "int8")
    lin = Linear(32, ("embed", "mlp"))
    got = lin.apply(variables(Weights({}, {"kernel": q})), x)
    want = pk.qmatmul(x, q, mode="weight_only", impl="xla")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert float(jnp.max(jnp.abs(got - x @ w))) < 0.05 * float(jnp.max(jnp.abs(x @ w)))


def test_forward_over_weights_with_nothing_prepared_is_the_float_forward():
    cfg = c2jax.config.default_config()
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.model.vocab_size)
    np.testing.assert_array_equal(c2jax.models.forward(cfg, Weights(params, {}), tokens),
                                  c2jax.models.forward(cfg, params, tokens))
