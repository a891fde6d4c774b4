"""Policy-gradient loss of the RL learner (Dr. GRPO defaults) and its config block.

    loss = - sum_{b,t} m_bt * sg(w_bt) * A_bt * log pi(x_bt) / N

  w_bt = min(exp(logp - logp_behaviour), is_cap)   truncated token-level importance weight,
                                                   detached; is_cap None -> w = 1 (on-policy)
  N    = num_sequences * constant_normalizer_len   normalizer "constant" (Dr. GRPO, default)
       | per-sequence 1 / len_b, then mean over b   normalizer "seq_len" (GRPO)
       | total number of loss tokens                normalizer "tokens" (DAPO token mean)
  m_bt = loss mask; with mask_overlong, also zero for sequences flagged truncated (the report
         keeps overlong rollouts: off by default).

So d loss / d logp_bt = -m_bt * w_bt * A_bt / N exactly. With ppo_clip, the per-token term is
PPO's min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(logp - logp_behaviour),
multiplied by sg(min(1, is_cap / rho)) when is_cap is set, so an unclipped token's gradient is
again -m * min(rho, is_cap) * A / N.

Letters: B = sequences, L = tokens per sequence (padded).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from c2jax.rl.advantages import broadcast_advantages
from c2jax.rl.kl import KL_ESTIMATORS, kl_estimate

NORMALIZERS = ("constant", "seq_len", "tokens")


def default_rl_loss_config() -> ml_collections.ConfigDict:
    """The RL objective's config block (advantages, KL, loss, reward shaping). Every value the
    report does not state is marked "not stated"."""
    c = ml_collections.ConfigDict()
    # --- advantages ---
    c.std_normalize = False  # GRPO's division by the group reward std; report: off (Dr. GRPO)
    c.std_eps = 1e-6  # added to the group std when std_normalize is on
    # scale of the advantages below the group mean: 1 (Dr. GRPO) pushes failed attempts down as
    # hard as it pulls passing ones up; 0 reinforces only the attempts above the mean (not stated)
    c.negative_advantage_scale = 1.0
    # --- KL to the reference policy (detached advantage penalty) ---
    c.kl_coef = 1e-3  # beta in adv_t -= beta * sg(kl_t); 0 skips the reference forward (not stated)
    c.kl_estimator = "k1"  # "k1" | "k2" | "k3"; report: k1 (k3's variance explodes with drift)
    c.kl_to_go = False  # True: penalize the sum of future per-token KLs instead of the token's own
    # --- loss ---
    c.normalizer = "constant"  # "constant" (Dr. GRPO) | "seq_len" (GRPO 1/len) | "tokens" (DAPO)
    c.constant_normalizer_len = 0  # L in N = num_sequences * L; 0 = the batch's padded length
    c.is_cap = ml_collections.config_dict.placeholder(float)  # None: weight 1; else min(ratio, cap)
    c.ppo_clip = False  # PPO ratio clipping against the behaviour policy (not stated; off)
    c.clip_eps_low = 0.2  # PPO clip range below 1 (used when ppo_clip)
    c.clip_eps_high = 0.2  # PPO clip range above 1 (used when ppo_clip)
    c.mask_overlong = False  # zero the loss of truncated rollouts; report: keep them (False)
    # --- reward: length penalty C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)) ---
    c.length_k = 1.0  # k: scale at which C bends (x is in "thousands of tokens"; not stated)
    c.length_q = 0.5  # q: concavity; 0 linear, 1 logarithmic (not stated)
    c.length_coef = 0.05  # reward -= length_coef * C(x) (not stated)
    c.effort_weights = ml_collections.ConfigDict({
        "thinking_tokens": 1e-3,  # per thinking token
        "tool_call_tokens": 1e-3,  # per token of tool-call arguments
        "tool_output_tokens": 2.5e-4,  # per token of tool output read back
        "final_message_tokens": 1e-3,  # per token of the final message
        "tool_calls": 0.05,  # per tool call
        "turns": 0.2,  # per model turn (> per call: rewards parallel calls)
    })
    c.behaviour_weights = ml_collections.ConfigDict({
        "malformed_calls": 0.1,  # reward -= w * number of malformed tool calls
        "unfinished_todos": 0.1,  # reward -= w * number of to-dos left open
        "comment_reasoning_lines": 0.01,  # reward -= w * lines of reasoning dumped in code comments
        "terminal_only": 0.1,  # reward -= w if the episode used only the terminal tool
    })
    return c


def validate_rl_loss_config(cfg) -> None:
    """Raise ValueError naming the bad field."""
    if cfg.normalizer not in NORMALIZERS:
        raise ValueError(f"rl.normalizer must be one of {NORMALIZERS}, got {cfg.normalizer!r}")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"rl.kl_estimator must be one of {KL_ESTIMATORS}, got {cfg.kl_estimator!r}")
    if not 0.0 <= cfg.negative_advantage_scale <= 1.0:
        raise ValueError(f"rl.negative_advantage_scale must be in [0, 1], got {cfg.negative_advantage_scale}")
    if cfg.is_cap is not None and not cfg.is_cap > 0:
        raise ValueError(f"rl.is_cap must be None or > 0, got {cfg.is_cap}")
    if cfg.constant_normalizer_len < 0:
        raise ValueError(f"rl.constant_normalizer_len must be >= 0 (0 = padded length), got "
                         f"{cfg.constant_normalizer_len}")
    if not (0 <= cfg.clip_eps_low < 1 and cfg.clip_eps_high >= 0):
        raise ValueError(f"rl.clip_eps_low must be in [0, 1) and clip_eps_high >= 0, got "
                         f"{cfg.clip_eps_low}, {cfg.clip_eps_high}")
    if not cfg.length_k > 0:
        raise ValueError(f"rl.length_k must be > 0, got {cfg.length_k}")
    if cfg.length_q < 0:
        raise ValueError(f"rl.length_q must be >= 0 (concave for q > 0), got {cfg.length_q}")
    if cfg.kl_coef < 0 or cfg.length_coef < 0:
        raise ValueError("rl.kl_coef and rl.length_coef must be >= 0")


def _masked_mean(x, mask, count):
    return jnp.sum(x * mask) / count


def _masked_p99(x, mask):
    """Nearest-rank 99th percentile of x over mask (0 if the mask is empty)."""
    flat = jnp.where(mask, x, -jnp.inf).reshape(-1)
    n = jnp.sum(mask).astype(jnp.int32)
    sorted_ = jnp.sort(flat)
    rank = jnp.clip(jnp.ceil(0.99 * n).astype(jnp.int32) - 1, 0, jnp.maximum(n - 1, 0))
    idx = flat.shape[0] - n + rank
    return jnp.where(n > 0, sorted_[jnp.clip(idx, 0, flat.shape[0] - 1)], 0.0)


def loss_token_count(loss_mask_BL, truncated_B, cfg):
    """Tokens the loss averages over (the "tokens" normalizer): the mask, less truncated rows
    when rl.mask_overlong."""
    mask = loss_mask_BL.astype(jnp.float32)
    if cfg.mask_overlong:
        mask = mask * (1.0 - truncated_B.astype(jnp.float32))[:, None]
    return jnp.maximum(jnp.sum(mask), 1.0)


def policy_loss(logp_BL, behaviour_logp_BL, advantages, loss_mask_BL, cfg, truncated_B=None,
                ref_logp_BL=None, num_sequences=None, num_tokens=None):
    """Dr. GRPO policy-gradient loss with truncated importance weights.

    Args:
      logp_BL: trainer log pi(x_t) of the sampled tokens (differentiated).
      behaviour_logp_BL: sampler's logprobs of the same tokens (the behaviour policy).
      advantages: shape (B,) or (B, L), already including any KL penalty (treated as data).
      loss_mask_BL: 1 on tokens the model produced.
      cfg: `default_rl_loss_config()` (normalizer, constant_normalizer_len, is_cap, ppo_clip,
        clip_eps_low/high, mask_overlong).
      truncated_B: bool, sequences that hit the length limit (needed when mask_overlong).
      ref_logp_BL: optional reference logprobs, only for the logged KL metrics.
      num_sequences: real sequences in the batch when rows past them are padding (a row count
        bucketed so chained rollouts do not recompile the step); default B.
      num_tokens: the "tokens" normalizer's count when this is one micro-batch of a larger batch
        (`loss_token_count` of the whole batch); default this batch's loss tokens.
    Returns:
      (loss scalar, metrics dict of scalars).
    """
    B, L = logp_BL.shape
    dtype = logp_BL.dtype
    behaviour_logp_BL = jax.lax.stop_gradient(behaviour_logp_BL.astype(dtype))
    adv_BL = jax.lax.stop_gradient(broadcast_advantages(advantages, (B, L)).astype(dtype))
    mask_BL = loss_mask_BL.astype(dtype)
    if cfg.mask_overlong:
        if truncated_B is None:
            raise ValueError("rl.mask_overlong is on but policy_loss got no truncated_B")
        mask_BL = mask_BL * (1.0 - truncated_B.astype(dtype))[:, None]

    # Padding may hold anything (-inf logprobs included): zero it so no NaN/inf reaches the
    # loss or its gradient (where() passes a zero cotangent to the unselected branch).
    on = mask_BL > 0
    logp_BL = jnp.where(on, logp_BL, 0.0)
    behaviour_logp_BL = jnp.where(on, behaviour_logp_BL, 0.0)
    log_ratio_BL = logp_BL - behaviour_logp_BL
    ratio_BL = jnp.exp(log_ratio_BL)
    ratio_sg = jax.lax.stop_gradient(ratio_BL)
    if cfg.is_cap is None:
        w_BL = jnp.ones_like(ratio_sg)
    else:
        w_BL = jnp.minimum(ratio_sg, cfg.is_cap)

    if cfg.ppo_clip:
        clipped = jnp.clip(ratio_BL, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
        surrogate = jnp.minimum(ratio_BL * adv_BL, clipped * adv_BL)
        if cfg.is_cap is not None:
            surrogate = surrogate * jnp.minimum(1.0, cfg.is_cap / ratio_sg)
        per_token_BL = -surrogate
        clip_frac_num = jnp.sum(mask_BL * (ratio_sg * adv_BL > jax.lax.stop_gradient(clipped) * adv_BL))
    else:
        per_token_BL = -w_BL * adv_BL * logp_BL
        clip_frac_num = jnp.array(0.0, dtype)

    batch_tokens = jnp.maximum(jnp.sum(mask_BL), 1.0)  # metrics average over this call's tokens
    num_tokens = batch_tokens if num_tokens is None else jnp.asarray(num_tokens, dtype)
    n_seq = jnp.asarray(B if num_sequences is None else num_sequences, dtype)
    if cfg.normalizer == "constant":
        norm_len = cfg.constant_normalizer_len or L
        loss = jnp.sum(per_token_BL * mask_BL) / (n_seq * norm_len)
    elif cfg.normalizer == "seq_len":
        len_B = jnp.maximum(jnp.sum(mask_BL, axis=-1), 1.0)
        loss = jnp.sum(jnp.sum(per_token_BL * mask_BL, axis=-1) / len_B) / n_seq
    elif cfg.normalizer == "tokens":
        loss = jnp.sum(per_token_BL * mask_BL) / num_tokens
    else:
        raise ValueError(f"rl.normalizer must be one of {NORMALIZERS}, got {cfg.normalizer!r}")

    # ---- metrics (no gradients) ----
    lr = jax.lax.stop_gradient(log_ratio_BL)
    abs_diff = jnp.abs(lr)
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "num_tokens": jnp.sum(mask_BL),
        "importance_ratio_mean": _masked_mean(ratio_sg, mask_BL, batch_tokens),
        "importance_ratio_max": jnp.max(jnp.where(on, ratio_sg, 0.0)),
        "importance_weight_mean": _masked_mean(w_BL, mask_BL, batch_tokens),
        "is_capped_fraction": (_masked_mean((ratio_sg > cfg.is_cap).astype(dtype), mask_BL, batch_tokens)
                               if cfg.is_cap is not None else jnp.array(0.0, dtype)),
        "clip_fraction": clip_frac_num / batch_tokens,
        # KL(pi_behaviour || pi) from behaviour samples: log r = logp - logp_behaviour.
        "kl_behaviour_k3": _masked_mean(jnp.expm1(lr) - lr, mask_BL, batch_tokens),
        "logprob_mismatch_mean_abs": _masked_mean(abs_diff, mask_BL, batch_tokens),
        "logprob_mismatch_p99": _masked_p99(abs_diff, on),
        "entropy_proxy": _masked_mean(-jax.lax.stop_gradient(logp_BL), mask_BL, batch_tokens),
        "advantage_mean": _masked_mean(adv_BL, mask_BL, batch_tokens),
    }
    if ref_logp_BL is not None:
        lp = jax.lax.stop_gradient(logp_BL)
        for est in KL_ESTIMATORS:
            ref = jnp.where(on, ref_logp_BL, 0.0)
            metrics[f"kl_ref_{est}"] = _masked_mean(kl_estimate(lp, ref, est), mask_BL, batch_tokens)
    return loss, metrics
