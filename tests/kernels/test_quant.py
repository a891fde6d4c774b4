"""Quantizer tests: numpy/ml_dtypes oracles, hypothesis properties, NaN/Inf policy, batch invariance."""
# Dim letters: M rows (tokens), K quantized axis.
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pallas_kernels as pk
from pallas_kernels.quant import reference as Q

SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
M, K = 4, 64

# Jit once per function: hypothesis examples reuse the compiled executables.
mx_q = jax.jit(pk.quantize_mxfp8)
mx_dq = jax.jit(pk.dequantize_mxfp8)
nv_q = jax.jit(pk.quantize_nvfp4, static_argnames="per_token")
nv_dq = jax.jit(pk.dequantize_nvfp4)
i8_q = jax.jit(pk.quantize_int8, static_argnames="axis")

finite_f32 = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)
# Mixed magnitudes (including exact zeros and tiny values) per element.
mags = st.sampled_from([0.0, 1e-6, 1e-3, 1.0, 30.0, 1e3])
matrices = hnp.arrays(np.float32, (M, K), elements=finite_f32.filter(lambda v: v == 0 or abs(v) > 1e-30))


@st.composite
def scaled_matrices(draw):
    # No f32 subnormals: XLA on CPU/TPU flushes them to zero (numpy does not).
    base = draw(hnp.arrays(np.int32, (M, K), elements=st.integers(-1000, 1000))) / np.float32(1000)
    scale = draw(hnp.arrays(np.float32, (M, K // 16), elements=mags))
    return (base * np.repeat(scale, 16, axis=1)).astype(np.float32)


# ---------------- independent numpy oracles (ml_dtypes casts) ----------------
def np_mxfp8(x):
    xb = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.max(np.where(np.isfinite(xb), np.abs(xb), 0), axis=-1, keepdims=True)
    e = np.ceil(np.log2(np.where(amax > 0, amax, 1) / np.float32(448))).astype(np.int32)
    # the ceil of log2 must be exact: adjust using exact power-of-two comparisons
    e = np.where(np.ldexp(np.float32(448), e - 1) >= amax, e - 1, e)
    e = np.where(np.ldexp(np.float32(448), e) < amax, e + 1, e)
    e = np.where(amax > 0, np.clip(e, -126, 127), 0)
    s = np.ldexp(np.float32(1), e).astype(np.float32)
    v = np.clip(xb / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return v.reshape(x.shape), s[..., 0]


def np_nvfp4(x):
    x = x.astype(np.float32)
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    ts = np.where(amax > 0, amax / np.float32(2688), np.float32(1)).astype(np.float32)
    xb = x.reshape(*x.shape[:-1], -1, 16)
    bamax = np.max(np.abs(xb), axis=-1, keepdims=True)
    bs = np.clip((bamax / np.float32(6)) / ts[..., None], 0, 448).astype(ml_dtypes.float8_e4m3fn)
    den = bs.astype(np.float32) * ts[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(den > 0, xb / np.where(den > 0, den, 1), 0).astype(np.float32)
    v = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn)
    return v.reshape(x.shape), bs[..., 0], ts[..., 0]


# ---------------- MXFP8 ----------------
@SETTINGS
@given(scaled_matrices())
def test_mxfp8_matches_numpy_oracle(x):
    v, s = mx_q(x)
    ov, os_ = np_mxfp8(x)
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8), ov.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s.astype(jnp.float32)), os_)


@SETTINGS
@given(matrices)
def test_mxfp8_properties(x):
    v, s = mx_q(x)
    s32 = np.asarray(s.astype(jnp.float32))
    # scales are powers of two, rounded up: amax/448 <= s < 2 * amax/448 (when amax > 0)
    m, _ = np.frexp(s32)
    assert np.all(m == 0.5)
    amax = np.abs(x).reshape(M, -1, 32).max(-1)
    assert np.all(amax <= 448 * s32)
    pos = amax > 448 * 2.0**-120  # below this the scale is clamped at 2^-126
    assert np.all(s32[pos] < 2 * amax[pos] / 448 * (1 + 1e-6))
    v32 = np.asarray(v.astype(jnp.float32))
    assert np.all(np.isfinite(v32)) and np.all(np.abs(v32) <= 448)
    d = np.asarray(mx_dq(v, s))
    srep = np.repeat(s32, 32, axis=1)
    # E4M3: 3 mantissa bits -> relative error <= 2^-4; subnormal step 2^-9 -> absolute <= 2^-10 * s
    bound = np.maximum(np.abs(x) * 2.0**-4, srep * 2.0**-10) * (1 + 1e-6)
    assert np.all(np.abs(d - x) <= bound)


def test_mxfp8_saturates_and_nan_inf_policy():
    x = np.ones((1, 32), np.float32)
    x[0, :4] = [np.nan, np.inf, -np.inf, 1e38]
    v, _s = pk.quantize_mxfp8(x)
    v32 = np.asarray(v.astype(jnp.float32))[0]
    assert np.isnan(v32[0]) and v32[1] == 448 and v32[2] == -448 and 256 <= v32[3] <= 448
    assert np.all(np.isfinite(v32[4:]))
    # no overflow even when a value rounds up past 448 * scale
    v2, _s2 = pk.quantize_mxfp8(np.full((1, 32), 464.0 * 2**3, np.float32))
    assert np.all(np.asarray(v2.astype(jnp.float32)) <= 448)
    z, zs = pk.quantize_mxfp8(np.zeros((2, 32), np.float32))
    assert np.all(np.asarray(z.astype(jnp.float32)) == 0) and np.all(np.isfinite(np.asarray(zs.astype(jnp.float32))))


def test_mxfp8_transposed_copy():
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    v0, s0 = pk.quantize_mxfp8(x, axis=0)
    v1, s1 = pk.quantize_mxfp8(x.T, axis=-1)
    assert s0.shape == (2, 96) and v0.shape == x.shape
    np.testing.assert_array_equal(np.asarray(v0.astype(jnp.float32)), np.asarray(v1.astype(jnp.float32)).T)
    np.testing.assert_array_equal(np.asarray(pk.dequantize_mxfp8(v0, s0, axis=0)),
                                  np.asarray(pk.dequantize_mxfp8(v1, s1)).T)


# ---------------- NVFP4 ----------------
@SETTINGS
@given(scaled_matrices())
def test_nvfp4_matches_numpy_oracle_exact_division(x):
    v, bs, ts = nv_q(x)
    ov, obs, ots = np_nvfp4(x)
    np.testing.assert_array_equal(np.asarray(ts), ots)
    np.testing.assert_array_equal(np.asarray(bs).view(np.uint8), obs.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32)), ov.astype(np.float32))


@SETTINGS
@given(scaled_matrices(), st.booleans())
def test_nvfp4_properties(x, per_token):
    v, bs, ts = nv_q(x, per_token=per_token)
    v32 = np.asarray(v.astype(jnp.float32))
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    assert np.all(np.isin(np.abs(v32), grid))
    bs32 = np.asarray(bs.astype(jnp.float32))
    assert np.all(np.isfinite(bs32)) and np.all((bs32 >= 0) & (bs32 <= 448))
    d = np.asarray(nv_dq(v, bs, ts))
    den = np.repeat(bs32, 16, axis=1) * np.reshape(np.asarray(ts), (-1, 1) if per_token else ())
    normal = np.repeat(bs32 >= 2.0**-6, 16, axis=1)  # E4M3 subnormal block scales lose precision
    bound = np.where(normal, 0.25 * np.abs(x), np.abs(x)) + 0.25 * den
    assert np.all(np.abs(d - x) <= bound * (1 + 1e-5) + 1e-30)


def test_nvfp4_nan_inf_policy():
    x = np.ones((1, 16), np.float32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    v, bs, ts = pk.quantize_nvfp4(x)
    v32 = np.asarray(v.astype(jnp.float32))[0]
    assert v32[0] == 0 and v32[1] == 6 and v32[2] == -6 and np.all(np.isfinite(v32))
    assert np.isfinite(float(ts[0])) and np.isfinite(float(bs.astype(jnp.float32)[0, 0]))
    z = pk.quantize_nvfp4(np.zeros((2, 32), np.float32))
    assert np.all(np.asarray(pk.dequantize_nvfp4(*z)) == 0)


@SETTINGS
@given(scaled_matrices(), hnp.arrays(np.float32, (M, K), elements=finite_f32), st.integers(0, M - 1))
def test_nvfp4_per_token_is_batch_invariant(x, other, row):
    """A row's quantized values and scales are bit-identical whatever the other rows hold."""
    y = other.copy()
    y[row] = x[row]
    a, b = nv_q(x), nv_q(y)
    for qa, qb in zip(a, b):
        ra, rb = np.asarray(qa)[row:row + 1], np.asarray(qb)[row:row + 1]
        np.testing.assert_array_equal(ra.view(np.uint8), rb.view(np.uint8))


def test_nvfp4_per_tensor_is_not_batch_invariant():
    x = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
    y = x.copy()
    y[1] *= 1000.0  # another row of the batch gets a large value
    da = np.asarray(pk.dequantize_nvfp4(*pk.quantize_nvfp4(x, per_token=False)))
    db = np.asarray(pk.dequantize_nvfp4(*pk.quantize_nvfp4(y, per_token=False)))
    assert not np.array_equal(da[0], db[0])
    pa = np.asarray(pk.dequantize_nvfp4(*pk.quantize_nvfp4(x)))
    pb = np.asarray(pk.dequantize_nvfp4(*pk.quantize_nvfp4(y)))
    np.testing.assert_array_equal(pa[0], pb[0])


# ---------------- int8 ----------------
@SETTINGS
@given(matrices, st.sampled_from([0, -1]))
def test_int8_properties(x, axis):
    q, s = i8_q(x, axis=axis)
    q = np.asarray(q)
    assert q.dtype == np.int8 and np.all(np.abs(q.astype(np.int32)) <= 127)
    d = np.asarray(pk.dequantize_int8(q, s))
    assert np.all(np.abs(d - x) <= np.asarray(s) * 0.5 * (1 + 1e-5) + 1e-30)


def test_int8_nan_inf_policy():
    x = np.array([[np.nan, np.inf, -np.inf, 2.0, -1.0]], np.float32)
    q, _s = pk.quantize_int8(x, axis=-1)
    assert np.asarray(q).tolist() == [[0, 127, -127, 127, -64]]


@pytest.mark.parametrize("fn,args", [
    (pk.quantize_mxfp8, (np.ones((2, 33), np.float32),)),
    (pk.quantize_nvfp4, (np.ones((2, 20), np.float32),)),
])
def test_bad_block_multiple_raises(fn, args):
    with pytest.raises(ValueError, match="multiple"):
        fn(*args)


def test_fake_quant_bad_name():
    with pytest.raises(ValueError, match="quant"):
        pk.fake_quant(np.ones((2, 32)), "fp3")


def test_exact_div_vs_xla_reciprocal_rewrite():
    """XLA turns x / broadcast(c) into x * (1/c) (inexact); exact_div must match IEEE division."""
    x = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    c = np.abs(x).max(-1, keepdims=True) / np.float32(2688)
    ieee = x / c
    naive = np.asarray(jax.jit(lambda a, b: a / b)(x, c))
    exact = np.asarray(jax.jit(Q.exact_div)(x, c))
    np.testing.assert_array_equal(exact, ieee)
    if jax.default_backend() == "cpu":
        assert (naive != ieee).any()  # documents why exact_div exists
