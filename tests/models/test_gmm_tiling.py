"""model.gmm_tiling: "auto" lets the grouped-matmul kernels choose tiles per call shape; "TM,TK,TN"
reaches every gmm / tgmm call of a train step's forward and backward (the same gradients either
way); anything else is a ConfigError."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from small_models import small_model_cfg
from c2jax.config import ConfigError, gmm_tiling_of
from pallas_kernels.gmm import tpu as gmm_tpu

B, L = 2, 16


def _grads(cfg):
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: jnp.asarray(cfg.model.init_std * rng.standard_normal(a.shape), a.dtype),
                          c2jax.models.abstract_params(cfg))
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (B, L)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))

    def loss(p):
        logits = c2jax.models.forward(cfg, p, tokens, pos, jnp.ones((B, L), jnp.int32))
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32), -1)[..., 0])
    return jax.grad(loss)(params)


def test_gmm_tiling_reaches_every_grouped_matmul_call(monkeypatch):
    seen = []
    for name in ("gmm_tpu", "tgmm_tpu"):
        real = getattr(gmm_tpu, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append((_name, kw.get("tiling")))
            return _real(*a, **kw)
        monkeypatch.setattr(gmm_tpu, name, spy)
    kw = {"kernels.experts": "pallas_gmm_interpret"}
    g_auto = _grads(small_model_cfg("gqa", **kw))
    assert seen and {t for _, t in seen} == {None}          # chosen inside the kernel per shape
    assert {n for n, _ in seen} == {"gmm_tpu", "tgmm_tpu"}
    seen.clear()
    g_set = _grads(small_model_cfg("gqa", gmm_tiling="16,128,128", **kw))
    assert seen and {t for _, t in seen} == {(16, 128, 128)}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), g_auto, g_set)


def test_gmm_tiling_values():
    cfg = small_model_cfg("gqa")
    assert gmm_tiling_of(cfg.model) is None
    cfg.model.gmm_tiling = "128,2048,768"
    assert gmm_tiling_of(cfg.model) == (128, 2048, 768)
    for bad in ("128,2048", "big", "100,2048,768", "128,100,768", "0,128,128"):
        cfg.model.gmm_tiling = bad
        with pytest.raises(ConfigError, match="model.gmm_tiling"):
            gmm_tiling_of(cfg.model)
