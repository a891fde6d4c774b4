"""Every Mosaic kernel lowers and compiles for TPU inside jax.shard_map (check_vma=True, the default)
on a v5p:2x2x2 mesh (data, fsdp, context, expert) = (2, 2, 2, 1), through the public entry points
with impl="pallas", on local blocks of sharded inputs; gradients go through the custom_vjp
backward kernels (weights invariant over the token axes, keys all-gathered over context).
Each program must hold the expected number of Mosaic kernels (`tpu_custom_call`)."""
# Dim letters: M rows, K contraction, N output, G experts, B batch, H q heads, Hk kv heads,
# L length, D head dim, S cache length.
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels.flash_attention import tpu as fa_tpu

topologies = pytest.importorskip("jax.experimental.topologies")
BF = jnp.bfloat16
AXES = ("data", "fsdp", "context", "expert")
TOKENS = P(AXES)  # rows of the MoE token buffer: every axis (each shard holds its own groups)


pytestmark = pytest.mark.usefixtures("no_persistent_cache")


@pytest.fixture(scope="module")
def mesh():
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    except (RuntimeError, ValueError, ImportError) as e:  # libtpu missing or too old
        pytest.skip(f"no TPU topology v5p:2x2x2: {e}")
    return Mesh(np.array(topo.devices).reshape(2, 2, 2, 1), AXES, axis_types=(AxisType.Auto,) * 4)


def _sds(mesh, shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(fn, *args, kernels):
    """Lower and compile for the TPU mesh; the lowered and the compiled program hold `kernels` Mosaic calls."""
    lowered = jax.jit(fn).lower(*args)
    assert lowered.as_text().count("tpu_custom_call") == kernels
    compiled = lowered.compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == kernels
    return compiled


@pytest.mark.parametrize("quant", ["none", "mxfp8"])
def test_gmm_fwd_and_grad_in_shard_map(mesh, quant):
    m, k, n, g = 2048, 256, 256, 4
    body = lambda a, w, gs: pk.gmm(a, w, gs, quant=quant, impl="pallas", preferred_element_type=BF)
    f = jax.shard_map(body, mesh=mesh, in_specs=(TOKENS, P("expert"), TOKENS), out_specs=TOKENS)
    args = (_sds(mesh, (m, k), BF, TOKENS), _sds(mesh, (g, k, n), BF, P("expert")),
            _sds(mesh, (8 * g,), jnp.int32, TOKENS))  # local group sizes per shard
    _compile(f, *args, kernels=1)
    # fwd + dX (gmm on the transposed weights) + dW (tgmm, summed over the token axes)
    loss = lambda a, w, gs: jnp.sum(jnp.square(f(a, w, gs).astype(jnp.float32)))
    _compile(jax.grad(loss, argnums=(0, 1)), *args, kernels=3)


def test_tgmm_in_shard_map(mesh):
    m, k, n, g = 2048, 256, 256, 4
    body = lambda a, dy, gs: pk.tgmm(a, dy, gs, impl="pallas")
    f = jax.shard_map(body, mesh=mesh, in_specs=(TOKENS, TOKENS, TOKENS), out_specs=TOKENS)
    _compile(f, _sds(mesh, (m, k), BF, TOKENS), _sds(mesh, (m, n), BF, TOKENS),
             _sds(mesh, (8 * g,), jnp.int32, TOKENS), kernels=1)


def _context_parallel_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Local queries against keys all-gathered over "context" (zigzag positions are arbitrary here)."""
    gather = lambda x, axis: jax.lax.all_gather(x, "context", axis=axis, tiled=True)
    return pk.flash_attention(q, gather(k, 2), gather(v, 2), q_positions_BL=q_pos, kv_positions_BS=gather(kv_pos, 1),
                              q_segment_ids_BL=q_seg, kv_segment_ids_BS=gather(kv_seg, 1), impl="pallas")


@pytest.mark.parametrize("schedule", ["table", "bounds"])
def test_flash_attention_positions_fwd_and_grad_in_shard_map(mesh, schedule, monkeypatch):
    """"table": block-skip schedule in SMEM; "bounds": the per-block bounds used when it would not fit."""
    if schedule == "bounds":
        monkeypatch.setattr(fa_tpu, "SCHEDULE_MAX_ENTRIES", 0)
    b, h, hk, l, d = 2, 4, 2, 2048, 128
    act, ids = P("data", "fsdp", "context"), P("data", "context")
    f = jax.shard_map(_context_parallel_attention, mesh=mesh, in_specs=(act, act, act, ids, ids, ids, ids),
                      out_specs=act)
    args = (_sds(mesh, (b, h, l, d), BF, act), _sds(mesh, (b, hk, l, d), BF, act),
            _sds(mesh, (b, hk, l, d), BF, act), *[_sds(mesh, (b, l), jnp.int32, ids)] * 4)
    if schedule == "table":
        _compile(f, *args, kernels=1)
    loss = lambda q, k, v, *masks: jnp.sum(f(q, k, v, *masks).astype(jnp.float32))
    _compile(jax.grad(loss, argnums=(0, 1, 2)), *args, kernels=3)  # fwd, dK/dV, dQ


def test_flash_attention_index_causal_grad_in_shard_map(mesh):
    b, h, hk, l, d = 2, 4, 2, 1024, 128
    act, ids = P("data", "fsdp"), P("data")
    body = lambda q, k, v, seg: pk.flash_attention(q, k, v, segment_ids_BL=seg, impl="pallas")
    f = jax.shard_map(body, mesh=mesh, in_specs=(act, act, act, ids), out_specs=act)
    loss = lambda q, k, v, seg: jnp.sum(f(q, k, v, seg).astype(jnp.float32))
    _compile(jax.grad(loss, argnums=(0, 1, 2)), _sds(mesh, (b, h, l, d), BF, act),
             _sds(mesh, (b, hk, l, d), BF, act), _sds(mesh, (b, hk, l, d), BF, act),
             _sds(mesh, (b, l), jnp.int32, ids), kernels=3)


def test_decode_attention_in_shard_map(mesh):
    b, h, hk, s, d = 8, 8, 4, 4096, 128
    sp = P("data", "fsdp")
    body = lambda q, kc, vc, lens: pk.decode_attention(q, kc, vc, lens, impl="pallas")
    f = jax.shard_map(body, mesh=mesh, in_specs=(sp, sp, sp, P("data")), out_specs=sp)
    _compile(f, _sds(mesh, (b, h, d), BF, sp), _sds(mesh, (b, hk, s, d), BF, sp), _sds(mesh, (b, hk, s, d), BF, sp),
             _sds(mesh, (b,), jnp.int32, P("data")), kernels=1)


@pytest.mark.parametrize("quant,mode", [("mxfp8", "weight_only"), ("int8", "weight_act")])
def test_qmatmul_in_shard_map(mesh, quant, mode):
    rows, cols = P(("data", "context")), P(None, "fsdp")
    body = lambda x, w: pk.qmatmul(x, pk.quantize_weight(w, quant), mode=mode, impl="pallas")
    f = jax.shard_map(body, mesh=mesh, in_specs=(rows, cols), out_specs=P(("data", "context"), "fsdp"))
    _compile(f, _sds(mesh, (1024, 512), BF, rows), _sds(mesh, (512, 512), BF, cols), kernels=1)
