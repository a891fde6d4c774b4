"""model.remat policies (c2jax.ops.remat): every policy gives the gradients of no
rematerialization, and each keeps what it names and no more: the saved residuals of a train
step's backward, with the Pallas flash-attention and grouped-matmul kernels run by the interpreter
so the kernels' own named residuals are exercised."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import c2jax
from small_models import small_model_cfg
from c2jax.config import REMAT_POLICIES, ConfigError, apply_overrides, validate

B, L = 2, 16


def _cfg(policy: str, attention: str = "gqa"):
    return small_model_cfg(attention, remat=policy, **{"kernels.attention": "pallas_flash_interpret",
                                                   "kernels.experts": "pallas_gmm_interpret"})


def _params(cfg):
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: jnp.asarray(cfg.model.init_std * rng.standard_normal(a.shape), a.dtype),
                        c2jax.models.abstract_params(cfg))


def _loss_fn(cfg):
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    seg = jnp.ones((B, L), jnp.int32)

    def loss(params, tokens, targets):
        logits = c2jax.models.forward(cfg, params, tokens, pos, seg)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))
    return loss


def _saved(cfg, params, tokens, targets) -> Counter:
    """Shapes of the residuals the backward keeps (a multiset)."""
    return Counter(tuple(a.shape) for a, _ in saved_residuals(_loss_fn(cfg), params, tokens, targets))


@pytest.fixture(scope="module")
def inputs():
    cfg = _cfg("none")
    k1, k2 = jax.random.split(jax.random.key(3))
    return (_params(cfg), jax.random.randint(k1, (B, L), 0, cfg.model.vocab_size, jnp.int32),
            jax.random.randint(k2, (B, L), 0, cfg.model.vocab_size, jnp.int32))


def test_every_policy_gives_the_unrematerialized_gradients(inputs):
    params, tokens, targets = inputs
    ref_loss, ref_g = jax.value_and_grad(_loss_fn(_cfg("none")))(params, tokens, targets)
    assert float(jnp.max(jnp.abs(ref_g["embed"]))) > 0
    for policy in REMAT_POLICIES[1:]:
        loss, g = jax.value_and_grad(_loss_fn(_cfg(policy)))(params, tokens, targets)
        assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6), policy
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-5, err_msg=policy)


def test_each_policy_keeps_what_it_names(inputs):
    """Against full remat (only each layer's input kept): save_qkv_proj adds the q, k, v
    projections of every layer, save_attention also the flash kernel's output and log-sum-exp;
    save_matmuls adds the output projection and the experts' gate, up and down rows to the q, k, v,
    save_matmuls_attention the flash residuals to those; save_dots keeps XLA's matmuls."""
    params, tokens, targets = inputs
    m = _cfg("full").model
    n, H, G, P, D = m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size
    A, F = B * L * m.num_experts_per_tok, m.moe_intermediate_size   # sorted expert rows, expert width
    saved = {p: _saved(_cfg(p), params, tokens, targets) for p in REMAT_POLICIES[1:]}

    def added(more, less):
        assert not saved[less] - saved[more], (more, less)
        return saved[more] - saved[less]
    qkv = Counter([(n, B, L, H * P), (n, B, L, G * P), (n, B, L, G * P)])
    assert added("save_qkv_proj", "full") == qkv
    flash = added("save_attention", "save_qkv_proj")
    assert sum(flash.values()) == 2 and flash[(n, B, H, L, P)] == 1, flash   # output, then lse
    assert added("save_matmuls", "save_qkv_proj") == Counter({(n, B, L, D): 1, (n, A, F): 2, (n, A, D): 1})
    assert added("save_matmuls_attention", "save_matmuls") == flash
    assert sum(added("save_dots", "full").values()) > 0


def test_mla_qkv_proj_keeps_the_query_and_latent_projections():
    """MLA (1 dense + 1 MoE layer, two stacks of one): the q up-projection and the kv latent + rope
    projection of each layer."""
    cfg = _cfg("full", "mla")
    m = cfg.model
    params = _params(cfg)
    k1, k2 = jax.random.split(jax.random.key(4))
    tokens, targets = (jax.random.randint(k, (B, L), 0, m.vocab_size, jnp.int32) for k in (k1, k2))
    full = _saved(cfg, params, tokens, targets)
    qkv = _saved(_cfg("save_qkv_proj", "mla"), params, tokens, targets)
    q = (1, B, L, m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim))
    assert qkv - full == Counter({q: 2, (1, B, L, m.kv_lora_rank + m.qk_rope_head_dim): 2})


def test_unknown_policy_is_a_config_error():
    cfg = small_model_cfg("gqa")
    apply_overrides(cfg, {"model.remat": "save_everything"})
    with pytest.raises(ConfigError, match="model.remat"):
        validate(cfg)
