"""gmm/tgmm: Pallas (interpret) and XLA paths against jax.lax.ragged_dot, forward and gradients."""
# Dim letters: M rows, K contraction, N output, G groups.
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import quant as Q
from pallas_kernels.gmm import reference

TILING = (64, 128, 128)


def J(f, **kw):
    """jit with static keyword arguments: one compile per test instead of op-by-op eager dispatch."""
    return jax.jit(functools.partial(f, **kw))


gmm_ref = jax.jit(reference.gmm_reference)  # small tiles: several row tiles per group, grids of <= ~100 steps


def _inputs(m, k, n, sizes, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), dy


# ragged sizes incl. empty groups, a partial last tile (M not a multiple of tm) and rows past sum
SHAPES = [
    (200, 256, 256, [37, 0, 100, 3, 50]),   # sum 190 < M=200; empty group
    (128, 128, 384, [0, 128, 0]),           # one group holds everything; empty first/last
    (50, 200, 136, [20, 30]),               # K and N not multiples of the tile: padded
]


@pytest.mark.parametrize("m,k,n,sizes", SHAPES)
def test_gmm_forward_interpret_and_xla_match_ragged_dot(m, k, n, sizes):
    lhs, rhs, gs, _ = _inputs(m, k, n, sizes)
    ref = gmm_ref(lhs, rhs, gs)
    out_i = J(pk.gmm, impl="interpret", tiling=TILING)(lhs, rhs, gs)
    out_x = J(pk.gmm, impl="xla")(lhs, rhs, gs)
    np.testing.assert_allclose(out_i, ref, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(out_x, ref, atol=2e-4, rtol=1e-4)
    total = int(np.sum(sizes))
    assert np.all(np.asarray(out_i)[total:] == 0)


def test_gmm_xla_more_shapes_and_bf16():
    for m, k, n, sizes in [(7, 32, 16, [3, 4]), (300, 64, 48, [0, 0, 150, 1, 149, 0]), (64, 32, 32, [0, 0])]:
        lhs, rhs, gs, _ = _inputs(m, k, n, sizes)
        np.testing.assert_allclose(J(pk.gmm, impl="xla")(lhs, rhs, gs), gmm_ref(lhs, rhs, gs),
                                   atol=2e-4, rtol=1e-4)
    lhs, rhs, gs, _ = _inputs(96, 128, 128, [40, 0, 56], jnp.bfloat16)
    ref = gmm_ref(lhs, rhs, gs)
    out = J(pk.gmm, impl="interpret", tiling=TILING, preferred_element_type=jnp.bfloat16)(lhs, rhs, gs)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2, rtol=2e-2)


def test_tgmm_interpret_and_xla_match_reference():
    lhs, _, gs, dy = _inputs(200, 128, 256, [37, 0, 100, 3, 50])
    ref = reference.tgmm_reference(lhs, dy, gs)
    # ragged_dot's own vjp is the oracle of the oracle
    _, vjp = jax.vjp(lambda w: reference.gmm_reference(lhs, w, gs), jnp.zeros((5, 128, 256)))
    np.testing.assert_allclose(vjp(dy)[0], ref, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(J(pk.tgmm, impl="interpret", tiling=TILING)(lhs, dy, gs), ref, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(J(pk.tgmm, impl="xla")(lhs, dy, gs), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["interpret", "xla", "ragged"])
def test_gmm_gradients_match_ragged_dot_autodiff(impl):
    lhs, rhs, gs, dy = _inputs(200, 128, 128, [37, 0, 100, 3, 50], seed=1)
    loss = lambda f: lambda a, b: jnp.sum(f(a, b) * dy)
    g_ref = jax.jit(jax.grad(loss(lambda a, b: reference.gmm_reference(a, b, gs)), argnums=(0, 1)))(lhs, rhs)
    kw = {"tiling": TILING} if impl == "interpret" else {}
    g = jax.jit(jax.grad(loss(lambda a, b: pk.gmm(a, b, gs, impl=impl, **kw)), argnums=(0, 1)))(lhs, rhs)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=3e-4, rtol=1e-4)


def test_bf16_outputs_and_gradients_round_once_from_the_f32_accumulator():
    """bf16 outputs (and the backward's bf16 dX / dW) are written by the kernel from its f32
    accumulator: bit-equal to the f32 result rounded once, with no f32 copy in between."""
    bf = jnp.bfloat16
    lhs, rhs, gs, dy = _inputs(200, 128, 256, [37, 0, 100, 3, 50], bf, seed=3)
    for impl in ("interpret", "xla"):
        kw = {"tiling": TILING} if impl == "interpret" else {}
        out32 = J(pk.gmm, impl=impl, **kw)(lhs, rhs, gs)
        out16 = J(pk.gmm, impl=impl, preferred_element_type=bf, **kw)(lhs, rhs, gs)
        assert out16.dtype == bf
        np.testing.assert_array_equal(np.asarray(out16, np.float32), np.asarray(out32.astype(bf), np.float32))
        _, vjp = jax.vjp(lambda a, b: pk.gmm(a, b, gs, impl=impl, preferred_element_type=bf, **kw), lhs, rhs)
        dx, dw = jax.jit(vjp)(dy)
        assert dx.dtype == bf and dw.dtype == bf
        dx32 = J(pk.gmm, impl=impl, **kw)(dy, jnp.swapaxes(rhs, 1, 2), gs)
        dw32 = J(pk.tgmm, impl=impl, **kw)(lhs, dy, gs)
        np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx32.astype(bf), np.float32))
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(dw32.astype(bf), np.float32))


@pytest.mark.parametrize("quant", ["mxfp8", "nvfp4", "int8"])
def test_quantized_gmm_forward(quant):
    lhs, rhs, gs, _ = _inputs(96, 128, 128, [40, 0, 50], seed=2)
    # numerics: ragged_dot of the quantize-dequantized operands (blocks along K)
    ref = reference.gmm_reference(Q.fake_quant(lhs, quant, -1), Q.fake_quant(rhs, quant, 1), gs)
    out_x = pk.gmm(lhs, rhs, gs, quant=quant, impl="xla")
    np.testing.assert_allclose(out_x, ref, atol=1e-4, rtol=1e-4)
    out_r = pk.gmm(lhs, rhs, gs, quant=quant, impl="reference")
    np.testing.assert_allclose(out_r, ref, atol=1e-4, rtol=1e-4)
    # quantization error is of the format's size relative to the exact product
    exact = gmm_ref(lhs, rhs, gs)
    rel = float(jnp.linalg.norm(out_x - exact) / jnp.linalg.norm(exact))
    assert rel < {"mxfp8": 0.06, "int8": 0.02, "nvfp4": 0.2}[quant], rel


@pytest.mark.parametrize("quant", ["mxfp8", "int8"])
def test_quantized_gmm_fused_kernel_forward(quant):
    """The TPU path feeds 1-byte operands + block scales to the kernel and dequantizes in VMEM."""
    lhs, rhs, gs, _ = _inputs(96, 128, 128, [40, 0, 50], seed=6)
    out_i = J(pk.gmm, quant=quant, impl="interpret", tiling=TILING)(lhs, rhs, gs)
    out_x = J(pk.gmm, quant=quant, impl="xla")(lhs, rhs, gs)
    np.testing.assert_allclose(out_i, out_x, atol=1e-5, rtol=1e-5)


def test_quantized_gmm_interpret_forward_and_backward():
    """NVFP4 forward + MXFP8 backward through the fused kernels (gmm, transposed-weight gmm, tgmm)."""
    lhs, rhs, gs, dy = _inputs(300, 128, 128, [120, 0, 150], seed=3)  # 2 row tiles in the MXFP8 tgmm
    loss = lambda impl: lambda a, b: jnp.sum(pk.gmm(a, b, gs, quant="nvfp4", impl=impl, tiling=TILING) * dy)
    v_i, g_i = jax.jit(jax.value_and_grad(loss("interpret"), argnums=(0, 1)))(lhs, rhs)
    v_r, g_r = jax.jit(jax.value_and_grad(loss("reference"), argnums=(0, 1)))(lhs, rhs)
    np.testing.assert_allclose(v_i, v_r, rtol=1e-4)
    for a, b in zip(g_i, g_r):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)
    # backward is MXFP8 (straight-through): close to the exact gradient, not equal to it
    g_exact = jax.jit(jax.grad(lambda a, b: jnp.sum(reference.gmm_reference(a, b, gs) * dy), argnums=(0, 1)))(lhs, rhs)
    for a, b in zip(g_i, g_exact):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert 0 < rel < 0.08, rel


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_gmm_nvfp4_per_token_batch_invariance(impl):
    """With per-token NVFP4 a row's output is bit-identical whatever the other rows hold."""
    lhs, rhs, gs, _ = _inputs(64, 128, 128, [30, 34], seed=4)
    lhs2 = lhs.at[1:].set(lhs[1:] * 1000.0 + 3.0)  # change every other row of the batch
    kw = {"impl": impl, "tiling": TILING} if impl == "interpret" else {"impl": impl}
    f = J(pk.gmm, quant="nvfp4", **kw)
    a, b = f(lhs, rhs, gs), f(lhs2, rhs, gs)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    # the per-tensor variant leaks the other rows into row 0
    pt = jax.jit(lambda x: pk.gmm(Q.dequantize_nvfp4(*Q.quantize_nvfp4(x, per_token=False)), rhs, gs, impl="xla"))
    a_pt, b_pt = pt(lhs), pt(lhs2)
    assert not np.array_equal(np.asarray(a_pt[0]), np.asarray(b_pt[0]))


def test_gmm_bad_inputs_raise_value_error():
    lhs, rhs, gs, _ = _inputs(64, 32, 32, [30, 34])
    with pytest.raises(ValueError, match="quant"):
        pk.gmm(lhs, rhs, gs, quant="fp4", impl="xla")
    with pytest.raises(ValueError, match="group_sizes_G"):
        pk.gmm(lhs, rhs, jnp.array([60, 10]), impl="xla")
    with pytest.raises(ValueError, match="group_sizes_G"):
        pk.gmm(lhs, rhs, jnp.array([10, 10, 10]), impl="xla")
    with pytest.raises(ValueError, match="lhs_MK"):
        pk.gmm(lhs[:, :16], rhs, gs, impl="xla")
    with pytest.raises(ValueError, match="rhs_GKN"):
        pk.gmm(lhs, rhs[0], gs, impl="xla")
    with pytest.raises(ValueError, match="impl"):
        pk.gmm(lhs, rhs, gs, impl="cuda")
    q = jnp.zeros((1, 2, 8, 16), jnp.float32) + 1.0
    with pytest.raises(ValueError, match="impl must be one of"):   # ragged_dot is the grouped matmuls' only
        pk.flash_attention(q, q, q, impl="ragged")
    with pytest.raises(ValueError, match="divisible"):
        pk.gmm(lhs[:, :24], rhs[:, :24], gs, quant="mxfp8", impl="xla")


def test_gmm_tgmm_under_tpu_semantics_interpreter():
    """pltpu.InterpretParams models TPU block residency/DMA (the generic interpreter does not)."""
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.gmm import tpu as gmm_tpu

    lhs, rhs, gs, dy = _inputs(160, 128, 128, [50, 0, 70, 0], seed=5)
    ip = pltpu.InterpretParams()
    out = jax.jit(lambda a, b, g: gmm_tpu.gmm_tpu(a, b, g, tiling=TILING, interpret=ip))(lhs, rhs, gs)
    np.testing.assert_allclose(out, gmm_ref(lhs, rhs, gs), atol=2e-4, rtol=1e-4)
    dw = jax.jit(lambda a, d, g: gmm_tpu.tgmm_tpu(a, d, g, tiling=TILING, interpret=ip))(lhs, dy, gs)
    np.testing.assert_allclose(dw, reference.tgmm_reference(lhs, dy, gs), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("quant", ["nvfp4"])
def test_prequantized_experts_match_on_the_fly_quantization(quant):
    """Inference path: weights quantized once give the same output as quantizing per call."""
    lhs, rhs, gs, _ = _inputs(96, 128, 128, [40, 0, 50], seed=7)
    qe = pk.quantize_experts(rhs, quant)
    ref = J(pk.gmm, quant=quant, impl="xla")(lhs, rhs, gs)
    np.testing.assert_array_equal(J(pk.gmm, impl="xla")(lhs, qe, gs), ref)
    np.testing.assert_allclose(J(pk.gmm, impl="interpret", tiling=TILING)(lhs, qe, gs), ref, atol=1e-5, rtol=1e-5)


def test_chosen_tiling_fits_vmem_and_beats_the_fixed_tiles_on_pod_shapes():
    """choose_tiling: within the VMEM budget and, on the pod shapes, faster by its model than the old
    fixed (256, 512, 1024) tiles; on Qwen3-30B-A3B's FSDP shapes (256 rows per expert) whole K and N
    with 128-row tiles (fewer straddled rows, no re-read of the weights per visit)."""
    from pallas_kernels.gmm import tpu as gt
    bf = jnp.dtype(jnp.bfloat16)
    shapes = [("gmm", 32768, 2048, 768, 128), ("gmm", 32768, 768, 2048, 128), ("tgmm", 32768, 2048, 768, 128),
              ("gmm", 65536, 7168, 4096, 48), ("tgmm", 65536, 2048, 7168, 48), ("gmm", 200, 256, 136, 5)]
    for kind, m, k, n, g in shapes:
        tiles = gt.choose_tiling(kind, m, k, n, g, bf, bf, bf)
        vmem = gt.gmm_vmem_bytes if kind == "gmm" else gt.tgmm_vmem_bytes
        assert vmem(tiles, bf, bf, bf) <= gt.TILE_VMEM_BUDGET
        assert tiles == gt._tiles(m, k, n, tiles)          # already clamped: the kernel runs these
        fixed = gt._tiles(m, k, n, gt.DEFAULT_TILING)
        if m > 1024:   # the pod shapes: the fixed tiles re-read the weights per visit or straddle more rows
            assert gt.tiling_seconds(kind, m, k, n, g, tiles, bf, bf, bf) < \
                0.9 * gt.tiling_seconds(kind, m, k, n, g, fixed, bf, bf, bf)
    assert gt.choose_tiling("gmm", 32768, 2048, 768, 128, bf, bf, bf) == (128, 2048, 768)
    # Kimi K2's expert up projection: whole K would not fit with whole N; the rule trades N tiles for it
    tm, tk, tn = gt.choose_tiling("gmm", 65536, 7168, 4096, 48, bf, bf, bf)
    assert tk == 7168 and tn < 4096


@pytest.mark.parametrize("m,k,n,sizes", SHAPES)
def test_gmm_and_tgmm_at_the_chosen_tiling_match_ragged_dot(m, k, n, sizes):
    lhs, rhs, gs, dy = _inputs(m, k, n, sizes, seed=3)
    np.testing.assert_allclose(J(pk.gmm, impl="interpret")(lhs, rhs, gs), gmm_ref(lhs, rhs, gs), atol=2e-4, rtol=1e-4)
    ref = reference.tgmm_reference(lhs, dy, gs, jnp.float32)
    np.testing.assert_allclose(J(pk.tgmm, impl="interpret")(lhs, dy, gs), ref, atol=2e-4, rtol=1e-4)
