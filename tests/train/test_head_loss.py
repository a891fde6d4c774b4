"""The fused output head + NLL against the unfused reference (logits, then token_nll), and the
trainer's loss through it against the logits path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.config import load_config
from c2jax.train.head_loss import head_token_nll
from c2jax.train.step import forward_nll, loss_terms, token_nll


def _inputs(T=24, D=16, V=40, seed=0, tied=False):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V, D) if tied else (D, V)) * 0.3, jnp.float32)
    t = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, T), jnp.float32)    # per-token cotangent weights
    return h, w, t, g


@pytest.mark.parametrize("V", [40, 64])   # 64: the NLL passes run as cpu_loss.cc's FFI calls on CPU
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1.0 / 0.7])
def test_fused_head_matches_logits_then_nll(tied, scale, V, monkeypatch):
    from c2jax.train import head_loss
    uses_kernel = head_loss._cpu_kernel_usable(jnp.zeros((2, V))) is None
    assert uses_kernel == (V == 64 and jax.default_backend() == "cpu"
                           and head_loss.cpu_kernels.unavailable() is None)
    calls = []
    real = jax.ffi.ffi_call
    monkeypatch.setattr(jax.ffi, "ffi_call", lambda name, *a, **k: calls.append(name) or real(name, *a, **k))
    h, w, t, g = _inputs(V=V, tied=tied, seed=int(tied))

    def ref(h, w):
        logits = (h @ (w.T if tied else w)) * scale
        nll, lse = token_nll(logits, t)
        return jnp.sum(nll * g) + 0.1 * jnp.sum(jnp.square(lse) * g), (nll, lse)

    def fused(h, w):
        nll, lse = head_token_nll(h, w, t, scale=scale, tied=tied)
        return jnp.sum(nll * g) + 0.1 * jnp.sum(jnp.square(lse) * g), (nll, lse)

    (v_r, aux_r), g_r = jax.value_and_grad(ref, argnums=(0, 1), has_aux=True)(h, w)
    (v_f, aux_f), g_f = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(h, w)
    np.testing.assert_allclose(v_f, v_r, rtol=1e-5)
    for a, b in zip(aux_f + g_f, aux_r + g_r):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(g_f[1]))) > 1e-3   # the weight gradient is really there
    if uses_kernel:
        assert calls == [head_loss.cpu_kernels.TOKEN_NLL_FWD, head_loss.cpu_kernels.TOKEN_NLL_BWD]


def test_fused_head_bf16_is_close_to_float32():
    h, w, t, _ = _inputs(T=32, D=32, V=64, seed=3)
    nll32, _ = head_token_nll(h, w, t)
    nll16, _ = head_token_nll(h.astype(jnp.bfloat16), w, t)
    assert nll16.dtype == jnp.float32
    np.testing.assert_allclose(nll16, nll32, atol=0.05)
    dh = jax.grad(lambda h: jnp.sum(head_token_nll(h, w, t)[0]))(h.astype(jnp.bfloat16))
    assert dh.dtype == jnp.bfloat16


@pytest.mark.parametrize("name,extra", [("tiny.py", ()), ("tiny.py:mla", ()),
                                        ("tiny.py", ("--config.model.tie_embeddings=True",))])
def test_loss_terms_fused_equal_logits_path(name, extra):
    cfg = load_config(f"configs/{name}", [*extra,
        "--config.model.hidden_size=32", "--config.model.num_layers=2", "--config.model.moe_intermediate_size=16",
        "--config.model.intermediate_size=32", "--config.model.vocab_size=96", "--config.model.init_std=0.1"])
    params = c2jax.models.init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(2)
    B, L = 2, 12
    x = rng.integers(0, 96, (B, L + 1)).astype(np.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": np.ones((B, L), np.int32),
             "positions": np.arange(L, dtype=np.int32)[None].repeat(B, 0),
             "loss_weights": rng.uniform(0.5, 1.0, (B, L)).astype(np.float32)}
    nll_f, lse_f, _ = forward_nll(cfg, params, batch, scale=1.3)
    nll_r, lse_r, _ = forward_nll(cfg, params, batch, scale=1.3, with_logits=True)
    np.testing.assert_allclose(nll_f, nll_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse_f, lse_r, rtol=1e-5, atol=1e-5)

    def loss(p, fused):
        if fused:
            terms = loss_terms(cfg, p, batch)
        else:
            nll, _, _ = forward_nll(cfg, p, batch, with_logits=True)
            terms = {"nll_sum": jnp.sum(nll * batch["loss_weights"])}
        return terms["nll_sum"]
    g_f = jax.grad(loss)(params, True)
    g_r = jax.grad(loss)(params, False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_f, g_r)
