"""pallas_kernels.gmm on its XLA path inside jax.shard_map (expert parallelism runs the local
experts there): the scan carry must be typed varying over the manual axes; values and gradients
equal the unsharded per-shard results."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk


@pytest.mark.parametrize("quant", ["none", "mxfp8"])
def test_gmm_xla_inside_shard_map_matches_per_shard(quant):
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((80, 64)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 64, 32)) / 8, jnp.float32)
    gs = jnp.asarray([15, 25, 10, 30], jnp.int32)

    def loss(f):
        return lambda a, w: jnp.sum(f(a, w) ** 2)

    def local(a, w, g):
        return pk.gmm(a, w, g, impl="xla", quant=quant)

    sharded = jax.shard_map(lambda a, w: local(a, w, gs.reshape(2, 2)[jax.lax.axis_index("x")]), mesh=mesh,
                            in_specs=(P("x"), P("x")), out_specs=P("x"))
    per_shard = lambda a, w: jnp.concatenate([local(a[:40], w[:2], gs[:2]), local(a[40:], w[2:], gs[2:])])
    v, g = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1)))(lhs, rhs)
    v_ref, g_ref = jax.jit(jax.value_and_grad(loss(per_shard), argnums=(0, 1)))(lhs, rhs)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gmm_weight_gradient_is_summed_over_axes_the_weight_is_replicated_on():
    """custom_vjp under shard_map: rows vary over x, the weight does not; its gradient is the sum
    of the per-shard gradients (what autodiff gives for the implicit broadcast)."""
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((80, 64)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((2, 64, 32)) / 8, jnp.float32)
    gs = jnp.asarray([15, 25], jnp.int32)
    local = lambda a, w: pk.gmm(a, w, gs, impl="xla")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    per_shard = lambda a, w: jnp.concatenate([local(a[:40], w), local(a[40:], w)])
    grad = lambda f: jax.jit(jax.grad(lambda a, w: jnp.sum(f(a, w) ** 2), argnums=(0, 1)))(lhs, rhs)
    for a, b in zip(grad(sharded), grad(per_shard)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
