"""split_dispatch (per-expert weight buffers, the decode path) equals dropless grouped dispatch,
and the MoE layer over stored per-expert buffers equals it over stacked weights, on fresh random inputs: few tokens (T*K < E), T*K >= E,
and skewed routing where one expert takes every token (the widest window)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.ops.weights import Weights, variables
from c2jax.ops.experts import decode_layout_experts
from c2jax.config import apply_overrides, load_config
from c2jax.models import moe as moe_lib
from c2jax.ops import experts_xla


def _inputs(rng, T, D, F, E, K, skew=False):
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    if skew:  # every token picks expert E-1 (window = T rows) plus one other
        ids = np.stack([[E - 1, rng.integers(0, E - 1)] for _ in range(T)])[:, :K]
    else:
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    ws = [jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, jnp.asarray(ids, jnp.int32), wts, ws


@pytest.mark.parametrize("T,E,K,skew", [(1, 8, 2, False), (3, 8, 2, False), (8, 8, 2, False),
                                        (13, 4, 2, False), (6, 8, 2, True), (5, 6, 1, False)])
def test_split_dispatch_equals_grouped_dispatch(T, E, K, skew):
    rng = np.random.default_rng(T * 100 + E)
    D, F = 16, 24
    x, ids, wts, ws = _inputs(rng, T, D, F, E, K, skew)
    experts = experts_xla.split_experts(*ws)
    got, dropped = jax.jit(decode_layout_experts)(x, ids, wts, experts)
    want = experts_xla.grouped_dispatch(x, ids, wts, *ws)[0]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert float(dropped) == 0.0


def test_window_widths_cover_every_count():
    for A in range(1, 70):
        w = experts_xla.window_widths(A)
        assert w[0] == 1 and w[-1] >= A and (len(w) == 1 or w[-2] < A)


@pytest.mark.parametrize("preset", ["configs/tiny.py", "configs/tiny.py:mla"])
def test_moe_layer_over_split_experts_equals_stacked(preset):
    """Routing (softmax; sigmoid + selection bias + groups), shared experts and the output equal
    the MoE module's on the same params, split per expert."""
    cfg = load_config(preset)
    apply_overrides(cfg, {"model.hidden_size": 32, "model.moe_intermediate_size": 16, "model.init_std": 0.2,
                          "model.moe_dispatch": "dropless"})
    m = cfg.model
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, m.hidden_size)), jnp.float32)
    layer = moe_lib.MoE(m)
    params = nn.meta.unbox(layer.init(jax.random.key(2), x)["params"])
    if "router_bias" in params:
        params = {**params, "router_bias": jnp.linspace(-0.3, 0.3, m.num_experts)}
    want_y, aux = layer.apply({"params": params}, x)
    sp = {k: v for k, v in params.items() if not k.startswith("w_")}
    experts = {"experts": experts_xla.split_experts(params["w_gate"], params["w_up"], params["w_down"])}
    y, got = jax.jit(lambda p, e, x: layer.apply(variables(Weights(p, e)), x))(sp, experts, x)
    np.testing.assert_array_equal(got["expert_ids"], aux["expert_ids"])
    np.testing.assert_allclose(y, want_y, atol=2e-5, rtol=1e-5)


