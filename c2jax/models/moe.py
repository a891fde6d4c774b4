"""Mixture of experts: routers (softmax / sigmoid with selection bias, group-limited), router
replay (forced expert ids), shared experts, auxiliary losses and the aux-loss-free bias update.
The routed experts themselves are one op (c2jax.ops.experts), dropless unless a training config
asks for capacity-limited dispatch.

Letters: T tokens (B*L), D model width, E experts, K experts per token, F expert MLP width,
C capacity per expert, A assignments (T*K), X group count.
"""
from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp

from c2jax.config import gmm_tiling_of
from c2jax.models.layers import MLP, dtype_of, kernels_of
from c2jax.ops import experts as experts_ops
from c2jax.ops import weights



# ----------------------------------------------------------------------------- routing


def _router_scores(logits_TE, bias_E, m):
    """(scores_TE, masked choice_TE): the scores the combine weights come from, and the (biased,
    group-limited, detached) scores the top-k chooses by."""
    T, E = logits_TE.shape
    logits_TE = logits_TE.astype(jnp.float32)
    if m.router == "softmax":
        scores_TE = jax.nn.softmax(logits_TE, axis=-1)
        choice_TE = scores_TE
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
        choice_TE = scores_TE + jax.lax.stop_gradient(bias_E.astype(jnp.float32)) if bias_E is not None else scores_TE
    choice_TE = jax.lax.stop_gradient(choice_TE)
    if m.n_group > 1:
        grouped = choice_TE.reshape(T, m.n_group, E // m.n_group)
        group_scores_TX = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, top_groups = jax.lax.top_k(group_scores_TX, m.topk_group)
        keep_TX = jnp.zeros((T, m.n_group), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
        keep_TE = jnp.repeat(keep_TX, E // m.n_group, axis=1)
        choice_TE = jnp.where(keep_TE, choice_TE, -jnp.inf)
    return scores_TE, choice_TE


def own_experts(logits_TE, bias_E, m):
    """The experts this router picks by itself: int32 [T, K]."""
    return jax.lax.top_k(_router_scores(logits_TE, bias_E, m)[1], m.num_experts_per_tok)[1].astype(jnp.int32)


def select_experts(logits_TE, bias_E, m, forced_ids_TK=None):
    """Route tokens. Returns (ids_TK, weights_TK, probs_TE, replaced_TK).

    Selection uses scores (+ bias for the sigmoid router, + group limits); combine weights use
    the unbiased scores of the chosen experts, optionally renormalized, times the routed scale.
    With forced_ids (router replay) the forced experts are used, but their weights still come
    from this router's scores, so the router gets gradients; a token whose forced row holds a
    -1 (nothing recorded, e.g. environment tokens) takes this router's own picks; a forced
    expert whose selection score is below `replay_threshold` x this router's own k-th score is
    replaced by this router's best pick not already chosen.
    """
    K = m.num_experts_per_tok
    scores_TE, masked_TE = _router_scores(logits_TE, bias_E, m)
    own_scores_TK, own_ids_TK = jax.lax.top_k(masked_TE, K)
    replaced_TK = jnp.zeros(own_ids_TK.shape, bool)
    if forced_ids_TK is None:
        ids_TK = own_ids_TK
    else:
        forced_TK = forced_ids_TK.astype(jnp.int32)
        ids_TK = jnp.where(jnp.all(forced_TK >= 0, axis=-1, keepdims=True), forced_TK, own_ids_TK)
        if m.replay_threshold > 0:
            ids_TK, replaced_TK = _replace_implausible(ids_TK, own_ids_TK, own_scores_TK, masked_TE,
                                                       m.replay_threshold)
    weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=-1)
    if m.norm_topk_prob:
        eps = 1e-20 if m.router == "sigmoid" else 0.0
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + eps)
    weights_TK = weights_TK * m.routed_scaling_factor
    return ids_TK, weights_TK, scores_TE, replaced_TK


def _replace_implausible(forced_TK, own_TK, own_scores_TK, choice_TE, threshold):
    forced_score_TK = jnp.take_along_axis(choice_TE, forced_TK, axis=-1)
    kth_T1 = own_scores_TK[:, -1:]
    implausible_TK = ~(forced_score_TK >= threshold * kth_T1)  # also catches -inf (masked group)
    kept_TK = jnp.where(implausible_TK, -1, forced_TK)
    own_taken_TK = jnp.any(own_TK[:, :, None] == kept_TK[:, None, :], axis=-1)
    avail_TK = ~own_taken_TK
    avail_rank_TK = jnp.cumsum(avail_TK, axis=-1) - 1
    repl_rank_TK = jnp.cumsum(implausible_TK, axis=-1) - 1
    match_TKK = avail_TK[:, None, :] & (avail_rank_TK[:, None, :] == repl_rank_TK[:, :, None])
    repl_TK = jnp.sum(jnp.where(match_TKK, own_TK[:, None, :], 0), axis=-1)
    return jnp.where(implausible_TK, repl_TK, forced_TK), implausible_TK


def update_router_bias(bias_E, expert_load_E, rate: float):
    """Aux-loss-free balancing step (DeepSeek-V3): raise the bias of under-loaded experts and
    lower it for over-loaded ones by `rate`. A non-gradient update applied after each step."""
    load = expert_load_E.astype(jnp.float32)
    return bias_E + rate * jnp.sign(jnp.mean(load) - load)


def capacity_factor_of(m) -> float | None:
    """The capacity factor a forward of model config m dispatches with: None (dropless) unless
    m.moe_dispatch == "capacity", which only the training step keeps (c2jax.models.forward
    and every other entry point make the config dropless first)."""
    return float(m.capacity_factor) if m.moe_dispatch == "capacity" else None


def make_dropless(m) -> None:
    """Set model config m (in place) so MoE dispatch never drops an assignment."""
    m.moe_dispatch = "dropless"


class MoE(nn.Module):
    """Routed experts (+ shared experts). Returns (y_BLD, aux) with aux holding the chosen expert
    ids, per-expert load, auxiliary losses and the dropped fraction."""

    cfg: object

    @nn.compact
    def __call__(self, x_BLD, forced_ids_BLK=None, stacked=None):
        """stacked: c2jax.ops.stacked.LayerExperts, this layer's expert weights as a layer of the scanned
        model's stacks (the CPU kernel reads them in place); None elsewhere."""
        m = self.cfg
        dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
        B, L, D = x_BLD.shape
        E, K, F = m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size
        init = nn.initializers.normal(m.init_std)
        router_w = self.param("router", nn.with_logical_partitioning(init, ("embed", None)), (D, E), pdt)
        bias = None
        if m.router_bias:
            bias = self.param("router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                              (E,), jnp.float32)
        x_TD = x_BLD.reshape(B * L, D)
        logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), router_w.astype(jnp.float32))
        forced = None if forced_ids_BLK is None else forced_ids_BLK.reshape(B * L, K)
        ids_TK, weights_TK, scores_TE, replaced_TK = select_experts(logits_TE, bias, m, forced)
        # the routed experts' weights, or the decode layout the sampler stored for them (c2jax.ops.weights)
        experts = weights.prepared_or(self, "experts", self._expert_weights)
        y_BLD, dropped = experts_ops.experts(kernels_of(m), x_TD.astype(dt).reshape(B, L, D), ids_TK.reshape(B, L, K),
                                             weights_TK.reshape(B, L, K), experts, quant=m.quant,
                                             capacity_factor=capacity_factor_of(m), stacked=stacked,
                                             tiling=gmm_tiling_of(m))
        if m.num_shared_experts:
            y_BLD = y_BLD + MLP(F * m.num_shared_experts, dt, pdt, m.init_std, kernels_of(m),
                                name="shared")(x_BLD)
        load_E = jnp.bincount(ids_TK.reshape(-1), length=E).astype(jnp.float32)
        frac_E = load_E / (B * L * K)
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
        aux = {
            "expert_ids": ids_TK.reshape(B, L, K).astype(jnp.int32),
            "expert_load": load_E,
            "load_balance_loss": E * jnp.sum(frac_E * jnp.mean(probs_TE, axis=0)),
            "router_z_loss": jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2),
            "dropped_fraction": dropped,
            "replaced_fraction": jnp.mean(replaced_TK.astype(jnp.float32)),
        }
        if forced is not None:   # router replay: where the replayed experts are this router's own picks
            own_TK = own_experts(logits_TE, bias, m)
            agree_T = jnp.all(jnp.sort(own_TK, axis=-1) == jnp.sort(forced.astype(jnp.int32), axis=-1), axis=-1)
            aux["route_agree"] = agree_T.reshape(B, L)
        return y_BLD.astype(x_BLD.dtype), aux

    def _expert_weights(self):
        """(w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]) in the compute dtype, each the
        float param or the form stored prepared for it (pre-quantized QuantizedExperts)."""
        m = self.cfg
        dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
        D, E, F = m.hidden_size, m.num_experts, m.moe_intermediate_size
        init = nn.initializers.normal(m.init_std)
        up = ("expert_weights", "expert_embed", "expert_mlp")
        return (weights.weight(self, "w_gate", init, up, (E, D, F), pdt, dt),
                weights.weight(self, "w_up", init, up, (E, D, F), pdt, dt),
                weights.weight(self, "w_down", init, ("expert_weights", "expert_mlp", "expert_embed"), (E, F, D),
                               pdt, dt))
