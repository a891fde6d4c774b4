"""The CPU MoE decode kernel (c2jax.backends.cpu.kernels): equals a float64 reference of the routed
SwiGLU sum and the XLA split dispatch for fresh random inputs, any row count (1-8 rows share an
expert stream, more run in blocks), skewed routing and ids no local expert serves; packs panels as
documented; refuses bad shapes and dtypes with clear errors; a failed build leaves the XLA path."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.ops.experts import decode_layout_experts
from c2jax.ops import experts_xla
from c2jax.backends.cpu import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU kernel")


def _weights(rng, E, D, F):
    return [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]


def _reference(x, ids, wts, w_gate, w_up, w_down):
    """float64 numpy: sum_k w[t,k] * (silu(x W_g) * (x W_u)) W_d for expert ids[t,k] in [0, E)."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if 0 <= e < wg.shape[0]:
                g, u = x[t] @ wg[e], x[t] @ wu[e]
                out[t] += float(wts[t, k]) * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


def test_kernel_builds_here():
    assert cpu_kernels.unavailable() is None


@pytest.mark.parametrize("T,E,K,D,F,skew", [(1, 4, 2, 32, 16, False), (8, 16, 2, 64, 32, False),
                                            (8, 16, 2, 64, 32, True), (13, 6, 3, 96, 48, True),
                                            (32, 8, 2, 32, 64, False)])
def test_moe_ffn_equals_float64_reference_and_split_dispatch(T, E, K, D, F, skew):
    rng = np.random.default_rng(T * 100 + E)
    ws = _weights(rng, E, D, F)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    if skew:  # most rows pick expert 1: blocks of 8 rows and a remainder share its stream
        ids = np.stack([np.r_[1, rng.choice(np.r_[0, 2:E], K - 1, replace=False)] for _ in range(T)])
    else:
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    ids = jnp.asarray(ids, jnp.int32)
    wts = jnp.asarray(rng.random((T, K)), jnp.float32)
    got = jax.jit(decode_layout_experts)(x, ids, wts, jax.jit(cpu_kernels.pack_experts)(*ws))[0]
    want = _reference(x, ids, wts, *ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    xla = jax.jit(decode_layout_experts)(x, ids, wts, experts_xla.split_experts(*ws))[0]
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_ids_outside_the_local_experts_add_nothing():
    rng = np.random.default_rng(3)
    E, D, F, T = 4, 32, 16, 5
    ws = _weights(rng, E, D, F)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    ids = jnp.asarray([[0, -1], [E, 2], [3, 1], [E + 7, -5], [2, 2]], jnp.int32)
    wts = jnp.asarray(rng.random((T, 2)), jnp.float32)
    got = jax.jit(cpu_kernels.moe_ffn)(x, ids, wts, cpu_kernels.pack_experts(*ws))
    want = _reference(x, ids, wts, *ws)
    assert np.all(np.asarray(got[3]) == 0) and np.abs(want[0]).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_pack_layout_is_panels_of_16_columns_split_by_device():
    rng = np.random.default_rng(1)
    E, D, F, n = 3, 32, 64, 2
    wg, wu, wd = _weights(rng, E, D, F)

    class Mesh2:  # pack_experts reads only .size
        size = n
    pk = cpu_kernels.pack_experts(wg, wu, wd, Mesh2())
    assert pk.w_gate_up.shape == (n, E, 2 * F // n // 16, D, 16) and pk.w_down.shape == (n, E, D // 16, F // n, 16)
    f = F // n
    # device 1, expert 2, panel 0 = gate columns [f, f + 16); panel f/16 = up columns [f, f + 16)
    np.testing.assert_array_equal(pk.w_gate_up[1, 2, 0], wg[2][:, f:f + 16])
    np.testing.assert_array_equal(pk.w_gate_up[1, 2, f // 16], wu[2][:, f:f + 16])
    # device 0, expert 1, down panel 1 = output columns [16, 32) of hidden rows [0, f)
    np.testing.assert_array_equal(pk.w_down[0, 1, 1], wd[1][:f, 16:32])


def test_bad_shapes_and_dtypes_are_refused_clearly():
    rng = np.random.default_rng(2)
    wg, wu, wd = _weights(rng, 4, 40, 16)
    assert "multiple of 32" in cpu_kernels.packable(wg)
    with pytest.raises(ValueError, match="cannot pack experts"):
        cpu_kernels.pack_experts(wg, wu, wd)
    assert "float32" in cpu_kernels.packable(wg.astype(jnp.bfloat16))
    wg, wu, wd = _weights(rng, 4, 32, 16)
    pk = cpu_kernels.pack_experts(wg, wu, wd)
    x = jnp.ones((3, 64), jnp.float32)  # width 64 against experts packed for 32
    with pytest.raises(Exception, match="do not match x"):
        cpu_kernels.moe_ffn(x, jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)), pk)


def test_failed_build_is_reported_and_the_decode_step_keeps_xla(tmp_path):
    code = ("import jax; from c2jax.backends.cpu import kernels as cpu_kernels; from c2jax.sampling import unrolled; "
            "import c2jax.sections; from c2jax import config; m = config.load_config_file('configs/tiny.py').model; "
            "print(cpu_kernels.unavailable().splitlines()[0]); print(unrolled.decode_layout(m))")
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "CXX": "false", "C2JAX_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    why, layout = out.stdout.strip().splitlines()
    assert why.startswith("cannot build cpu_kernels.cc") and layout == "split"
    assert "CPU kernels off, decoding and training run through XLA: cannot build" in out.stderr
    env["C2JAX_CPU_KERNELS"], env["CXX"] = "0", "g++"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip().splitlines() == ["C2JAX_CPU_KERNELS=0", "split"], out.stderr


@pytest.mark.parametrize("M,K,N", [(1, 32, 32), (5, 48, 96), (8, 64, 64), (13, 40, 128), (32, 16, 64)])
def test_packed_matmul_equals_float64(M, K, N):
    rng = np.random.default_rng(M * K)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    got = jax.jit(cpu_kernels.matmul)(x, cpu_kernels.pack_matrix(w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_matrix_packing_refuses_what_the_kernel_cannot_run():
    assert "multiple of 32" in cpu_kernels.matrix_packable(jnp.ones((8, 97)))
    assert "float32" in cpu_kernels.matrix_packable(jnp.ones((8, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="cannot pack a \\(8, 48\\) weight"):
        cpu_kernels.pack_matrix(jnp.ones((8, 48)))
    pm = cpu_kernels.pack_matrix(jnp.ones((8, 64)))
    with pytest.raises(Exception, match="does not match x"):
        cpu_kernels.matmul(jnp.ones((2, 9)), pm)
