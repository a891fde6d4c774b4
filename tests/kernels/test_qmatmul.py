"""Quantized matmul: fused-dequant Pallas kernel (interpret) vs the jnp reference, and format accuracy."""
# Dim letters: M rows, K contraction, N output channels.
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

M, K, N = 40, 512, 256  # M not a multiple of the row tile; two K tiles
TILING = (32, 256, 128)
REL_ERR = {"int8": 0.02, "mxfp8": 0.06, "nvfp4": 0.2}


@pytest.fixture(scope="module")
def xw():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((M, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32))


@pytest.mark.parametrize("quant", ["int8", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("mode", ["weight_only", "weight_act"])
def test_qmatmul_kernel_matches_reference(xw, quant, mode):
    x, w = xw
    qw = pk.quantize_weight(w, quant)
    ref = pk.qmatmul(x, qw, mode=mode, impl="reference")
    out = jax.jit(functools.partial(pk.qmatmul, mode=mode, impl="interpret", tiling=TILING))(x, qw)
    # operands are exact in bf16, accumulation is f32: only summation order differs
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    exact = x @ w
    rel = float(jnp.linalg.norm(ref - exact) / jnp.linalg.norm(exact))
    assert rel < REL_ERR[quant], rel


def test_qmatmul_quantizes_float_weights_and_checks_inputs(xw):
    x, w = xw
    a = pk.qmatmul(x, w, quant="mxfp8", impl="xla")
    b = pk.qmatmul(x, pk.quantize_weight(w, "mxfp8"), impl="xla")
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="mode"):
        pk.qmatmul(x, w, quant="int8", mode="act_only", impl="xla")
    with pytest.raises(ValueError, match="quant"):
        pk.qmatmul(x, w, quant="fp6", impl="xla")
    with pytest.raises(ValueError, match="w must be"):
        pk.qmatmul(x, w[:100], quant="int8", impl="xla")
    with pytest.raises(ValueError, match="divisible"):
        pk.qmatmul(x[:, :40], w[:40], quant="mxfp8", impl="xla")
