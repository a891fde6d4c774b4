"""model.scan_unroll changes how the layer stack is compiled, never what it computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.config import ConfigError, load_config


@pytest.mark.parametrize("unroll", [2, 8])
def test_unrolled_layer_scan_equals_scanned(unroll):
    base = ["--config.model.hidden_size=32", "--config.model.num_layers=3", "--config.model.first_k_dense=0",
            "--config.model.moe_intermediate_size=16", "--config.model.vocab_size=64", "--config.model.init_std=0.1"]
    cfg1 = load_config("configs/tiny.py", base)
    cfg2 = load_config("configs/tiny.py", [*base, f"--config.model.scan_unroll={unroll}"])
    params = c2jax.models.init_params(cfg1, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)

    def loss(cfg, p):
        return jnp.sum(jax.nn.log_softmax(c2jax.models.forward(cfg, p, tokens))[..., 1])
    l1, g1 = jax.value_and_grad(lambda p: loss(cfg1, p))(params)
    l2, g2 = jax.jit(jax.value_and_grad(lambda p: loss(cfg2, p)))(params)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g2, g1)


def test_scan_unroll_must_be_positive():
    with pytest.raises(ConfigError, match="scan_unroll"):
        load_config("configs/tiny.py", ["--config.model.scan_unroll=0"])


def test_run_config_written_before_a_new_key_loads_with_its_default(tmp_path):
    import json

    from c2jax.train.loop import _save_config, load_run_config
    cfg = load_config("configs/tiny.py")
    _save_config(cfg, str(tmp_path))
    d = json.loads((tmp_path / "config.json").read_text())
    del d["model"]["scan_unroll"]                      # a run launched before the key existed
    (tmp_path / "config.json").write_text(json.dumps(d))
    old = load_run_config(str(tmp_path))
    assert old.model.scan_unroll == 1 and old.model.hidden_size == cfg.model.hidden_size
    c2jax.models.init_params(old, jax.random.key(0))
