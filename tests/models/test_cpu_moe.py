"""The CPU routed-expert kernel (c2jax/backends/cpu/cpu_moe.cc) against references: float64 numpy for
the forward (with capacity drops and ids outside the experts), a dense jnp SwiGLU over every
expert for the gradients, XLA's block path for the dropped fraction, and the model's training
loss and gradients with both CPU training kernels off."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.ops import experts as experts_ops
from c2jax.ops import experts_xla
from c2jax.ops import record_choices
from c2jax.ops.stacked import LayerExperts
from c2jax.backends.cpu import attention as cpu_attention
from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.backends.cpu import moe as cpu_moe

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable()}")


def _inputs(T, K, E, D, F, seed):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, D))
    wg = jax.random.normal(ks[1], (E, D, F)) * D ** -0.5
    wu = jax.random.normal(ks[2], (E, D, F)) * D ** -0.5
    wd = jax.random.normal(ks[3], (E, F, D)) * F ** -0.5
    weights, ids = jax.lax.top_k(jax.nn.softmax(2 * jax.random.normal(ks[4], (T, E))), K)
    return x, ids.astype(jnp.int32), weights, wg, wu, wd, jax.random.normal(ks[5], (T, D))


def _kept(ids, E, cap):
    """bool [T, K]: assignment kept (expert in range and among its first cap in token order)."""
    flat = np.asarray(ids).reshape(-1)
    seen, keep = np.zeros(E, int), np.zeros(flat.shape, bool)
    for a, e in enumerate(flat):
        if 0 <= e < E and seen[e] < cap:
            seen[e] += 1
            keep[a] = True
    return keep.reshape(ids.shape)


def _reference64(x, ids, weights, wg, wu, wd, cap):
    x, weights, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, weights, wg, wu, wd))
    ids = np.asarray(ids)
    keep = _kept(ids, wg.shape[0], cap)
    out = np.zeros_like(x)
    for t, k in zip(*np.nonzero(keep)):
        e = ids[t, k]
        g, u = x[t] @ wg[e], x[t] @ wu[e]
        out[t] += weights[t, k] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


def _dense(x, ids, weights, wg, wu, wd, keep):
    """The same layer as every expert on every token, masked: a simpler jnp path for gradients."""
    g = jnp.einsum("td,edf->tef", x, wg)
    y = jnp.einsum("tef,efd->ted", jax.nn.silu(g) * jnp.einsum("td,edf->tef", x, wu), wd)
    w_TE = jnp.zeros((x.shape[0], wg.shape[0])).at[jnp.arange(x.shape[0])[:, None], ids].add(weights * keep)
    return jnp.einsum("ted,te->td", y, w_TE)


# (600, 2, 2, ...): ~600 rows an expert, several of the kernel's row chunks forward (192) and backward (256)
@pytest.mark.parametrize("T,K,E,D,F,cap", [(50, 2, 4, 64, 128, 50), (300, 2, 8, 128, 64, 40),
                                           (129, 3, 5, 64, 64, 129), (600, 2, 2, 64, 128, 600)])
def test_kernel_matches_references(T, K, E, D, F, cap):
    x, ids, weights, wg, wu, wd, cot = _inputs(T, K, E, D, F, T)
    if T == 129:
        ids = ids.at[::7, 0].set(E + 2).at[::11, 1].set(-1)   # outside the experts: add nothing
    assert cpu_moe.usable(x, wg) is None
    out = jax.jit(lambda *a: cpu_moe.expert_ffn(*a, cap))(x, ids, weights, wg, wu, wd)
    np.testing.assert_allclose(out, _reference64(x, ids, weights, wg, wu, wd, cap), rtol=2e-5, atol=2e-5)

    keep = jnp.asarray(_kept(ids, E, cap), jnp.float32)
    argn = (0, 2, 3, 4, 5)
    g_ker = jax.jit(jax.grad(lambda x, i, w, *ws: jnp.sum(cpu_moe.expert_ffn(x, i, w, *ws, cap) * cot),
                             argnums=argn))(x, ids, weights, wg, wu, wd)
    g_ref = jax.grad(lambda x, i, w, *ws: jnp.sum(_dense(x, i, w, *ws, keep) * cot), argnums=argn)(
        x, jnp.clip(ids, 0, E - 1), weights, wg, wu, wd)
    for a, b in zip(g_ker, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_capacity_dispatch_takes_the_kernel_and_reports_drops_like_xla():
    x, ids, weights, wg, wu, wd, _ = _inputs(300, 2, 8, 128, 64, 1)
    with record_choices() as rec:
        out, dropped = experts_ops.experts({"experts": "cpu_ffi"}, x[None], ids[None], weights[None], wg, wu, wd,
                                           capacity_factor=1.0)
    assert rec == {"experts": {"cpu_ffi": 1}} and float(dropped) > 0
    cap = experts_xla.capacity(300, 2, 8, 1.0)
    out_xla, dropped_xla = experts_xla.capacity_dispatch(x, ids, weights, wg, wu, wd, cap)
    np.testing.assert_allclose(out[0], out_xla, rtol=1e-5, atol=1e-5)
    assert float(dropped) == pytest.approx(float(dropped_xla))


def test_refusals():
    x, ids, weights, wg, wu, wd, _ = _inputs(20, 2, 4, 64, 64, 2)
    assert "float32" in cpu_moe.usable(x.astype(jnp.bfloat16), wg)
    assert "multiples of 64" in cpu_moe.usable(x[:, :32], wg[:, :32])
    with pytest.raises(RuntimeError, match="cannot run: activations or expert weights are not float32"):
        cpu_moe.expert_ffn(x, ids, weights, wg.astype(jnp.bfloat16), wu, wd, 20)
    with pytest.raises(Exception, match="shapes of x, ids, weights and the expert weights disagree"):
        cpu_moe._ffn(x, ids, weights, wg, wu, wd, wg[None], wu[None], wd[None, :, :, :32], jnp.int32(0),
                     20)   # the FFI call's own check
    with pytest.raises(Exception, match="layer index outside the stacked weights"):
        cpu_moe._ffn(x, ids, weights, wg, wu, wd, wg[None], wu[None], wd[None], jnp.int32(1), 20)
    with pytest.raises(ValueError, match="do not hold layers of"):
        cpu_moe.expert_ffn(x, ids, weights, wg, wu, wd, 20,
                           stacked=LayerExperts(wg[None], wu[None], wd[None, :, :32], jnp.int32(0)))


def test_stacked_weights_read_in_place():
    """A layer of stacked weights (the scanned model's params) gives what the layer's own weights
    give, outputs and gradients; the per-layer weights' values are not read."""
    x, ids, weights, wg, wu, wd, cot = _inputs(300, 2, 4, 64, 128, 7)
    rng = np.random.default_rng(1)
    others = [jnp.asarray(rng.standard_normal((2,) + w.shape) * 0.05, jnp.float32) for w in (wg, wu, wd)]
    stacks = [jnp.concatenate([o[:1], w[None], o[1:]]) for o, w in zip(others, (wg, wu, wd))]   # layer 1 of 3

    def loss_stacked(x, weights, wg, wu, wd):
        view = LayerExperts(*stacks, jnp.int32(1))
        # other values, the same gradient: the per-layer values must not matter
        junk = lambda w: w + jax.lax.stop_gradient(jnp.full_like(w, 3.0) - w)  # noqa: E731
        return jnp.sum(cpu_moe.expert_ffn(x, ids, weights, junk(wg), junk(wu), junk(wd), 150, stacked=view) * cot)

    def loss_layer(x, weights, wg, wu, wd):
        return jnp.sum(cpu_moe.expert_ffn(x, ids, weights, wg, wu, wd, 150) * cot)

    l_s, g_s = jax.jit(jax.value_and_grad(loss_stacked, argnums=(0, 1, 2, 3, 4)))(x, weights, wg, wu, wd)
    l_l, g_l = jax.jit(jax.value_and_grad(loss_layer, argnums=(0, 1, 2, 3, 4)))(x, weights, wg, wu, wd)
    assert float(l_s) == float(l_l)
    for a, b in zip(g_s, g_l):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(g_s[2]).max()) > 0   # the gradients reach the per-layer weights


def test_training_loss_and_grads_equal_with_cpu_kernels_off(monkeypatch):
    """The tiny model (float32) trains through the attention and expert kernels; the same loss and
    gradients with both off (XLA's causal blocks and block dispatch)."""
    from c2jax import config
    from c2jax.models import Transformer, init_params
    cfg = config.load_config_file("configs/tiny.py")
    m = cfg.model
    m.dtype = m.param_dtype = "float32"
    m.kernels.experts, m.kernels.attention = "cpu_ffi", "cpu_ffi"
    model = Transformer(m)
    params = init_params(cfg, jax.random.key(0))
    B, L = 2, 48
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, m.vocab_size, (B, L)), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(30), np.arange(18)]))[None].repeat(B, 0)   # two segments
    seg = jnp.asarray(np.repeat([1, 2], [30, 18]))[None].repeat(B, 0)

    def loss(p):
        logits = model.apply({"params": p}, ids, pos, seg)[0]
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1))

    calls, stacked = [], []
    for mod, name in ((cpu_moe, "expert_ffn"), (cpu_attention, "causal_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: calls.append(name) or stacked.append(
            k.get("stacked")) or real(*a, **k))
    l_ker, g_ker = jax.value_and_grad(loss)(params)
    assert set(calls) == {"expert_ffn", "causal_attention"}, "the training forward did not use both kernels"
    assert any(v is not None for v in stacked), "the scanned MoE layers did not pass their stacked weights"
    m.kernels.experts, m.kernels.attention = "xla_blocks", "xla_blocked"
    model = Transformer(m)
    with record_choices() as rec:
        l_xla, g_xla = jax.value_and_grad(loss)(params)
    assert set(rec["experts"]) == {"xla_blocks"} and set(rec["attention"]) == {"xla_blocked"}
    np.testing.assert_allclose(l_ker, l_xla, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_ker), jax.tree.leaves(g_xla)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


def test_layers_computing_in_another_dtype_than_their_params_get_no_stacks(monkeypatch):
    """bfloat16 params cast to float32 layers: the kernel runs on the cast per-layer weights, not on
    the (bfloat16) stacks, and gives the XLA path's output."""
    from c2jax import config
    from c2jax.models import forward, init_params
    cfg = config.load_config_file("configs/tiny.py")
    cfg.model.dtype, cfg.model.param_dtype = "float32", "bfloat16"
    params = init_params(cfg, jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 24)), jnp.int32)
    seen = []
    real = cpu_moe.expert_ffn
    monkeypatch.setattr(cpu_moe, "expert_ffn", lambda *a, **k: seen.append(k.get("stacked")) or real(*a, **k))
    cfg.model.kernels.experts = "cpu_ffi"
    out = forward(cfg, params, ids)
    assert seen and all(v is None for v in seen)
    cfg.model.kernels.experts = "xla_blocks"
    np.testing.assert_allclose(out, forward(cfg, params, ids), rtol=1e-4, atol=1e-4)
