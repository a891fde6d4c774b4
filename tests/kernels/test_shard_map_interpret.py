"""Numerics of the kernels inside jax.shard_map (check_vma=True) on 4 fake CPU devices, run by the
Pallas TPU interpreter (impl="interpret" picks it inside shard_map): context-parallel flash attention
(zigzag token order, local queries against all-gathered keys, explicit positions) and gmm with expert
weights replicated over the token axes. Gradients must equal the unsharded reference's, i.e. the
custom_vjp cotangents of invariant inputs are summed over the axes they were broadcast along."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import AxisType, Mesh, PartitionSpec as P
    import pallas_kernels as pk
    from pallas_kernels.flash_attention.reference import attention_reference

    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)

    # --- flash attention, zigzag context parallelism: rank r holds chunks r and 3 - r of 4
    B, H, Hk, C, D, E = 2, 2, 1, 64, 32, 16
    order = [0, 3, 1, 2]
    pos = np.concatenate([np.arange(c * C, (c + 1) * C) for c in order])
    pos_BL = jnp.asarray(np.tile(pos, (B, 1)), jnp.int32)
    seg_BL = jnp.asarray(np.stack([pos >= 100, pos >= 170]).astype(np.int32) + np.array([[0], [5]]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, H, 4 * C, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hk, 4 * C, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hk, 4 * C, E)), jnp.float32)
    do = jnp.asarray(rng.standard_normal((B, H, 4 * C, E)), jnp.float32)

    def local(q, k, v, p, s):
        gather = lambda x, axis: jax.lax.all_gather(x, "context", axis=axis, tiled=True)
        return pk.flash_attention(q, gather(k, 2), gather(v, 2), q_positions_BL=p, kv_positions_BS=gather(p, 1),
                                  q_segment_ids_BL=s, kv_segment_ids_BS=gather(s, 1), impl="interpret",
                                  block_sizes=(64, 64, 64, 64))
    act, ids = P("data", None, "context"), P("data", "context")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(act, act, act, ids, ids), out_specs=act)
    ref = lambda q, k, v, p, s: attention_reference(q, k, v, q_segment_ids_BL=s, kv_segment_ids_BS=s,
                                                    q_positions_BL=p, kv_positions_BS=p)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, pos_BL, seg_BL) * do)
    out, grads = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    ref_out, ref_grads = jax.value_and_grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5)
    for g, r, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=name)
    print("flash ok")

    # --- gmm: tokens over both axes, expert weights replicated (invariant): dW summed over 4 shards
    M, K, N = 256, 128, 128
    lhs = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((2, K, N)) / 10, jnp.float32)
    gs = jnp.asarray([30, 34, 0, 64, 10, 50, 40, 24], jnp.int32)  # per shard: 2 local group sizes
    tok = P(("data", "context"))
    body = lambda a, w, g: pk.gmm(a, w, g, impl="interpret", tiling=(64, 128, 128))
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(tok, P(), tok), out_specs=tok)
    per_shard = lambda a, w, g: jnp.concatenate(
        [pk.gmm(a[i * 64:(i + 1) * 64], w, g[2 * i:2 * i + 2], impl="reference") for i in range(4)])
    loss = lambda f: lambda a, w: jnp.sum(jnp.square(f(a, w, gs)))
    grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1)))(lhs, rhs)
    ref_grads = jax.grad(loss(per_shard), argnums=(0, 1))(lhs, rhs)
    for g, r, name in zip(grads, ref_grads, ("dlhs", "drhs")):
        np.testing.assert_allclose(g, r, atol=2e-4, rtol=1e-4, err_msg=name)
    print("gmm ok")
''')


def test_kernels_inside_shard_map_match_unsharded_reference():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "flash ok" in res.stdout and "gmm ok" in res.stdout
