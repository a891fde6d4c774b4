"""Group advantages (Dr. GRPO) and the detached per-token KL penalty.

Composer 2 (report section 3): advantage = reward - mean reward of the prompt's group, with
no division by the group std (GRPO's std normalization is a switch, off by default). The KL to
a reference policy enters as a *detached* per-token advantage penalty with the k1 estimator:
    adv_t <- adv_t - kl_coef * stop_gradient(log pi(x_t) - log pi_ref(x_t)).
k1 is only a correct gradient in this detached form (see kl.py); k2 / k3 are available for
comparison.

Letters: P = prompts (groups) in the batch, G = group size (attempts per prompt),
B = sequences (= P * G when grouped), L = tokens per sequence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from c2jax.rl.kl import kl_estimate


def group_advantages(rewards_PG, std_normalize: bool = False, std_eps: float = 1e-6,
                     negative_scale: float = 1.0):
    """adv = r - mean_group(r); with std_normalize, divided by (std_group(r) + std_eps); then
    negative advantages are multiplied by negative_scale (1: Dr. GRPO; 0: only the attempts
    above their group's mean are reinforced).

    The std is the population std (ddof 0). A group whose rewards are all equal gets zero
    advantage either way.
    """
    rewards_PG = jnp.asarray(rewards_PG, dtype=jnp.result_type(float, rewards_PG))
    adv_PG = rewards_PG - jnp.mean(rewards_PG, axis=-1, keepdims=True)
    if std_normalize:
        adv_PG = adv_PG / (jnp.std(rewards_PG, axis=-1, keepdims=True) + std_eps)
    if negative_scale != 1.0:
        adv_PG = jnp.where(adv_PG < 0, adv_PG * negative_scale, adv_PG)
    return adv_PG


def group_advantages_by_id(rewards_B, group_ids_B, num_groups: int, std_normalize: bool = False,
                           std_eps: float = 1e-6):
    """Same as `group_advantages` for a flat batch where group_ids_B in [0, num_groups) says
    which prompt each sequence belongs to (groups may have different sizes, e.g. after a
    sample was dropped)."""
    rewards_B = jnp.asarray(rewards_B, dtype=jnp.result_type(float, rewards_B))
    seg = lambda v: jax.ops.segment_sum(v, group_ids_B, num_segments=num_groups)
    count_P = jnp.maximum(seg(jnp.ones_like(rewards_B)), 1.0)
    mean_B = (seg(rewards_B) / count_P)[group_ids_B]
    adv_B = rewards_B - mean_B
    if std_normalize:
        var_B = (seg(jnp.square(adv_B)) / count_P)[group_ids_B]
        adv_B = adv_B / (jnp.sqrt(var_B) + std_eps)
    return adv_B


def broadcast_advantages(advantages, shape_BL):
    """Per-sequence advantages_B -> advantages_BL; per-token advantages pass through."""
    advantages = jnp.asarray(advantages)
    if advantages.ndim == 1:
        return jnp.broadcast_to(advantages[:, None], shape_BL)
    if advantages.shape != tuple(shape_BL):
        raise ValueError(f"advantages have shape {advantages.shape}; expected (B,) or {tuple(shape_BL)}")
    return advantages


def kl_penalty(logp_BL, logp_ref_BL, loss_mask_BL, estimator: str = "k1", to_go: bool = False):
    """Detached per-token KL penalty kl_t (zero on masked tokens).

    to_go=False: kl_t = k(x_t), the per-token penalty of the report.
    to_go=True:  kl_t = sum_{s >= t} k(x_s), the reward-to-go of the sequence KL, whose
                 score-function gradient is exactly grad KL(pi || pi_ref) of the sequence.
    """
    mask = loss_mask_BL.astype(logp_BL.dtype)
    kl_BL = jax.lax.stop_gradient(kl_estimate(logp_BL, logp_ref_BL, estimator)) * mask
    if to_go:
        kl_BL = jnp.flip(jnp.cumsum(jnp.flip(kl_BL, axis=-1), axis=-1), axis=-1) * mask
    return kl_BL


def apply_kl_penalty(advantages, logp_BL, logp_ref_BL, loss_mask_BL, kl_coef: float,
                     estimator: str = "k1", to_go: bool = False):
    """adv_BL - kl_coef * stop_gradient(kl_t). Accepts advantages of shape (B,) or (B, L).

    Pass the trainer's current logp (any gradient through it is stopped here).
    """
    adv_BL = broadcast_advantages(advantages, logp_BL.shape)
    return adv_BL - kl_coef * kl_penalty(logp_BL, logp_ref_BL, loss_mask_BL, estimator, to_go)
