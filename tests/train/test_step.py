"""Train-step numerics: grad accumulation, non-finite skip, bias update, MTP mask, optimizer masks."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import c2jax
from c2jax.config import ConfigError, load_config
from c2jax.ops import current_target
from c2jax.ops.optimizer import OPTIMIZER
from c2jax.train.optimizer import decay_mask, frozen_labels, make_optimizer
from c2jax.train.step import init_state, mtp_distill_loss, train_step


def _cfg(*extra):
    return load_config("configs/tiny.py:mla", [
        "--config.model.hidden_size=32", "--config.model.num_layers=2", "--config.model.moe_intermediate_size=16",
        "--config.model.intermediate_size=32", "--config.model.moe_dispatch=dropless",
        "--config.model.vocab_size=128", "--config.model.init_std=0.1", "--config.train.warmup_steps=0", *extra])


def _batch(B=4, L=16, V=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, (B, L)).astype(np.int32)
    seg = np.where(np.arange(L) < L // 2, 1, 2).astype(np.int32)[None].repeat(B, 0)
    pos = np.concatenate([np.arange(L // 2), np.arange(L - L // 2)]).astype(np.int32)[None].repeat(B, 0)
    w = rng.uniform(0.5, 1.0, (B, L)).astype(np.float32)
    return {"inputs": x, "targets": np.roll(x, -1, 1), "segment_ids": seg, "positions": pos, "loss_weights": w}


def test_grad_accumulation_matches_full_batch():
    # without MTP heads: their distillation term, like the MoE auxiliary losses, is a mean of
    # per-microbatch means (train.step.total_loss), not a pooled mean over the batch
    cfg1 = _cfg("--config.model.num_mtp_layers=0")
    cfg2 = _cfg("--config.model.num_mtp_layers=0", "--config.train.grad_accum=2")
    params = c2jax.models.init_params(cfg1, jax.random.key(0))
    opt = optax.sgd(1.0)  # params - grads: compares the accumulated gradients themselves
    batch = _batch()
    s1, m1 = jax.jit(lambda s, b: train_step(cfg1, opt, s, b))(init_state(cfg1, opt, params, 0), batch)
    s2, m2 = jax.jit(lambda s, b: train_step(cfg2, opt, s, b))(init_state(cfg2, opt, params, 0), batch)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4), s1["params"], s2["params"])


def test_nonfinite_step_is_skipped_and_counted():
    cfg = _cfg()
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    opt = make_optimizer(cfg.train)
    state = init_state(cfg, opt, params, 0)
    batch = _batch()
    batch["loss_weights"][0, 3] = np.nan
    new, m = jax.jit(lambda s, b: train_step(cfg, opt, s, b))(state, batch)
    assert int(m["skipped"]) == 1 and int(new["step"]) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), new["params"], params)
    good, m = jax.jit(lambda s, b: train_step(cfg, opt, s, b))(new, _batch(seed=1))
    assert int(m["skipped"]) == 0
    assert not np.allclose(good["params"]["embed"], params["embed"])


def test_router_bias_moves_against_load_and_is_not_optimized():
    cfg = _cfg("--config.model.bias_update_rate=0.01")
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    opt = make_optimizer(cfg.train)
    new, m = jax.jit(lambda s, b: train_step(cfg, opt, s, b))(init_state(cfg, opt, params, 0), _batch())
    load = np.asarray(m["expert_load"])          # [N, E]
    bias = np.asarray(new["params"]["moe_layers"]["block"]["moe"]["router_bias"])
    expected = 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(bias, expected, atol=1e-7)


def test_optimizer_masks():
    cfg = _cfg()
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    mask = decay_mask(params)
    assert mask["lm_head"]["kernel"] and not mask["embed"] and not mask["final_norm"]["scale"]
    labels = frozen_labels(params)
    assert labels["moe_layers"]["block"]["moe"]["router_bias"] == "frozen"
    assert labels["moe_layers"]["block"]["moe"]["router"] == "train"


def test_mtp_distill_loss_masks_segment_boundaries():
    rng = np.random.default_rng(0)
    B, L, V = 2, 8, 11
    logits = jnp.asarray(rng.normal(size=(B, L, V)), jnp.float32)
    mtp = jnp.asarray(rng.normal(size=(1, B, L, V)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]] * B)
    w = jnp.ones((B, L))
    # depth 1, aligned: position t holds the prediction made at t - 1 (segment of t - 1; -1 at t = 0)
    mtp_seg = jnp.concatenate([jnp.full((B, 1), -1), seg[:, :-1]], axis=1)[None]
    total, weight = mtp_distill_loss(mtp, logits, w, seg, mtp_seg)
    assert float(weight) == B * (L - 1 - 1)   # pairs (t - 1, t) inside a segment
    p = jax.nn.softmax(logits[:, 1:], -1)
    lq = jax.nn.log_softmax(mtp[0, :, 1:], -1)
    ce = -(p * lq).sum(-1) * (seg[:, :-1] == seg[:, 1:])
    np.testing.assert_allclose(total, ce.sum(), rtol=1e-5)
    # Gradient flows to the MTP head only, never into the teacher.
    g = jax.grad(lambda lg: mtp_distill_loss(mtp, lg, w, seg, mtp_seg)[0])(logits)
    assert float(jnp.abs(g).max()) == 0.0


@pytest.mark.parametrize("impl", ["optax_adamw", "cpu_fused_adamw"])
def test_adam_eps_is_the_configured_one(impl):
    """One AdamW step from zero moments: update = -lr * g / (|g| + eps) (bias-corrected, no decay),
    through each implementation's plain optax update."""
    why = OPTIMIZER.why_not(impl, current_target())
    if why:
        pytest.skip(why)
    cfg = _cfg("--config.train.adam_eps=1e-3", "--config.train.weight_decay=0.0", "--config.train.grad_clip=0.0",
               "--config.train.warmup_steps=0", f"--config.train.optimizer={impl}")
    opt = make_optimizer(cfg.train)
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(5,)), jnp.float32)}
    g = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(5,)) * 1e-3, jnp.float32)}
    updates, _ = opt.update(g, opt.init(params), params)
    lr = float(cfg.train.lr)
    # the fused update is new params - params: optax's to within one rounding of the params
    rtol = 1e-5 if impl == "optax_adamw" else 1e-4
    np.testing.assert_allclose(updates["w"], -lr * g["w"] / (jnp.abs(g["w"]) + 1e-3), rtol=rtol)


def test_bad_adam_eps_is_a_config_error():
    with pytest.raises(ConfigError, match="train.adam_eps"):
        _cfg("--config.train.adam_eps=0")
