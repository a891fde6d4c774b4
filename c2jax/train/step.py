"""Loss and the jitted train step: cross-entropy on weighted targets, z-loss, MoE auxiliary
losses, MTP self-distillation, gradient accumulation, non-finite skip, router-bias update.

Letters: B batch, L length, V vocab, A microbatches, N MoE layers, E experts.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from c2jax.models import flops_per_token, forward, head_weight, update_router_bias
from c2jax.models.layers import kernels_of
from c2jax.models.transformer import model_cfg, unrolled_stacks
from c2jax.ops import token_nll as token_nll_op
from c2jax.train.head_loss import chunked_head_distill, chunked_head_token_nll
from c2jax.treepath import flatten_by_path, key_names

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_weights")


def token_nll(logits_BLV, targets_BL):
    """Per-token negative log-likelihood (float32) and logsumexp."""
    return _nll_lse(logits_BLV.astype(jnp.float32), targets_BL)


@jax.custom_vjp
def _nll_lse(logits_BLV, targets_BL):
    return token_nll_op.xla_forward(logits_BLV, targets_BL)


def _nll_lse_fwd(logits_BLV, targets_BL):
    nll_BL, lse_BL = _nll_lse(logits_BLV, targets_BL)
    return (nll_BL, lse_BL), (logits_BLV, targets_BL, lse_BL)


def _nll_lse_bwd(res, cts):
    # d/dlogits in one elementwise pass over the [B, L, V] logits (token_nll's XLA backward)
    logits_BLV, targets_BL, lse_BL = res
    g_nll, g_lse = cts
    return token_nll_op.xla_backward(logits_BLV, lse_BL, targets_BL, g_nll, g_lse).astype(logits_BLV.dtype), None


_nll_lse.defvjp(_nll_lse_fwd, _nll_lse_bwd)


def forward_nll(cfg, params, batch, forced_expert_ids=None, *, scale: float = 1.0, with_logits: bool = False,
                train_dispatch: bool = False, mtp: bool | None = None, mtp_trunk_grad: bool = True):
    """(nll_BL, lse_BL, ForwardOutput) of the batch's targets under logits * scale. Without
    with_logits the output head runs fused with the loss (c2jax.train.head_loss; out.logits then
    holds the final hidden states). mtp: run the MTP heads (default: with with_logits; their
    outputs in out.aux, with_logits=False: the states mtp_distill_terms reads)."""
    out = forward(cfg, params, batch["inputs"], batch["positions"], batch["segment_ids"],
                  forced_expert_ids=forced_expert_ids, return_aux=True, head=with_logits,
                  train_dispatch=train_dispatch, mtp=mtp, mtp_trunk_grad=mtp_trunk_grad)
    if with_logits:
        nll_BL, lse_BL = token_nll(out.logits * scale if scale != 1.0 else out.logits, batch["targets"])
        return nll_BL, lse_BL, out
    w, tied = head_weight(cfg, params)
    m = model_cfg(cfg)
    # a fully unrolled layer stack (scan_unroll >= layers) is the straight-line program whose
    # compiled cost counts every layer: the head's chunks are unrolled there too
    nll_BL, lse_BL = chunked_head_token_nll(out.logits, w, batch["targets"], chunks=int(m.get("head_chunks", 1)),
                                            scale=scale, tied=tied, kernels=kernels_of(m),
                                            unroll=m.scan_unroll >= m.num_layers)
    return nll_BL, lse_BL, out


def mtp_distill_loss(mtp_logits_DBLV, logits_BLV, loss_weights_BL, segment_ids_BL, mtp_segment_ids_DBL):
    """Self-distillation of each MTP depth to the main head's (detached) distribution at the same
    position: mtp_logits[d - 1] at t is the prediction made at t - d (the model's aux
    `mtp_logits`, aligned so under context parallelism no logits move); masked where t - d leaves
    the row or the segment (mtp_segment_ids differs). Returns (sum, weight)."""
    total, weight = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    teacher_BLV = jax.nn.softmax(jax.lax.stop_gradient(logits_BLV.astype(jnp.float32)), axis=-1)
    for d in range(mtp_logits_DBLV.shape[0]):
        student = jax.nn.log_softmax(mtp_logits_DBLV[d].astype(jnp.float32), axis=-1)
        ce_BL = -jnp.sum(teacher_BLV * student, axis=-1)
        w_BL = loss_weights_BL * (mtp_segment_ids_DBL[d] == segment_ids_BL)
        total += jnp.sum(ce_BL * w_BL)
        weight += jnp.sum(w_BL)
    return total, weight


def trains_mtp(cfg) -> bool:
    """Whether a training step distils MTP heads: the model has them and train.mtp_loss_weight > 0."""
    return bool(model_cfg(cfg).num_mtp_layers) and float(cfg.train.mtp_loss_weight) > 0


def train_flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs per token of this config's training step: 6N + attention, plus the MTP heads
    where the step distils them (trains_mtp)."""
    return flops_per_token(cfg, seq_len, training=True, mtp=trains_mtp(cfg))


def mtp_distill_terms(cfg, params, out, loss_weights_BL, segment_ids_BL, head_grad: bool = True):
    """(sum_P, weight_P) float32 per MTP depth: mtp_distill_loss's terms from a head=False
    forward's aux["mtp_hidden"] (out.logits = the final hidden states), the head applied in
    model.head_chunks sequence chunks (c2jax.train.head_loss.chunked_head_distill) so no [B, L, V]
    logits are materialized whole. head_grad=False: the output head gets no gradient from it."""
    m = model_cfg(cfg)
    aux = out.aux
    w_PBL = loss_weights_BL.astype(jnp.float32)[None] * (aux["mtp_segment_ids"] == segment_ids_BL[None])
    w, tied = head_weight(cfg, params)
    w = w if head_grad else jax.lax.stop_gradient(w)
    return chunked_head_distill(out.logits, aux["mtp_hidden"], w, w_PBL, chunks=int(m.get("head_chunks", 1)),
                                tied=tied, unroll=m.scan_unroll >= m.num_layers)


def mtp_metrics(sum_P, weight_P):
    """mtp_loss (all depths) and mtp_loss_{p} per depth p = 1..P from summed terms."""
    out = {"mtp_loss": jnp.sum(sum_P) / jnp.maximum(jnp.sum(weight_P), 1.0)}
    for p in range(sum_P.shape[-1]):
        out[f"mtp_loss_{p + 1}"] = sum_P[..., p] / jnp.maximum(weight_P[..., p], 1.0)
    return out


def loss_terms(cfg, params, batch, forced_expert_ids=None):
    """Sums (not means) of every loss term over one microbatch, plus router aux outputs."""
    nll_BL, lse_BL, out = forward_nll(cfg, params, batch, forced_expert_ids, train_dispatch=True,
                                      mtp=trains_mtp(cfg))
    w = batch["loss_weights"].astype(jnp.float32)
    terms = {"nll_sum": jnp.sum(nll_BL * w), "weight": jnp.sum(w),
             "z_sum": jnp.sum(jnp.square(lse_BL) * w)}
    if "mtp_hidden" in out.aux:
        terms["mtp_sum"], terms["mtp_weight"] = mtp_distill_terms(cfg, params, out, w, batch["segment_ids"])
    if "expert_load" in out.aux:
        terms["lb_loss"] = jnp.mean(out.aux["load_balance_loss"])
        terms["z_router"] = jnp.mean(out.aux["router_z_loss"])
        terms["expert_load"] = out.aux["expert_load"]            # [N, E]
        terms["dropped_fraction"] = jnp.mean(out.aux["dropped_fraction"])
    return terms


def total_loss(cfg, terms, total_weight, num_micro):
    """Combine summed terms into the scalar that is differentiated."""
    t = cfg.train
    m = model_cfg(cfg)
    loss = terms["nll_sum"] / total_weight
    if t.z_loss:
        loss += t.z_loss * terms["z_sum"] / total_weight
    if "mtp_sum" in terms:
        loss += (t.mtp_loss_weight * jnp.sum(terms["mtp_sum"]) / jnp.maximum(jnp.sum(terms["mtp_weight"]), 1.0)
                 / num_micro)
    if "lb_loss" in terms:
        loss += (m.load_balance_loss_weight * terms["lb_loss"] + m.router_z_loss_weight * terms["z_router"]
                 ) / num_micro
    return loss


def apply_if_finite(optimizer, params, opt_state, grads, loss, after=None, unrolled=()):
    """(new params, new optimizer state, finite, grad norm): the optimizer step (then `after` on
    the new params) when loss and gradients are finite, else params and state unchanged.
    An optimizer with an in-place step (`apply_in_place`: train.optimizer's cpu_fused_adamw,
    c2jax.ops.optimizer) runs that, the gate inside; `unrolled`: the stacks whose gradients it
    reads layer by layer (its global_norm too). Any other optax transformation runs as below.

    One reduction decides: a NaN or inf anywhere in the gradients makes their norm non-finite (so
    does a sum of squares past float32 range, where clipping would zero the update anyway). A
    cond, not a select per leaf: XLA runs one branch, so a good step makes no extra pass over
    params and optimizer state (~0.1 s a step on the 89M CPU bench)."""
    in_place = getattr(optimizer, "apply_in_place", None)
    if in_place is not None:
        grad_norm = optimizer.global_norm(grads, unrolled)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_params, new_opt = in_place(params, opt_state, grads, finite, grad_norm, unrolled)
        if after:  # only the leaves `after` replaced need the gate
            bumped = after(new_params)
            new_params = jax.tree.map(lambda b, n: n if b is n else jnp.where(finite, b, n), bumped, new_params)
        return new_params, new_opt, finite, grad_norm

    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(operands):
        params, opt_state, grads = operands
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return (after(new_params) if after else new_params), new_opt

    new_params, new_opt = jax.lax.cond(finite, update, lambda operands: operands[:2], (params, opt_state, grads))
    return new_params, new_opt, finite, grad_norm


def _apply_bias_update(cfg, params, expert_load_NE):
    m = model_cfg(cfg)
    if not (m.router_bias and m.bias_update_rate > 0) or "moe_layers" not in params:
        return params
    moe = params["moe_layers"]["block"]["moe"]
    new_bias = jax.vmap(lambda b, l: update_router_bias(b, l, m.bias_update_rate))(moe["router_bias"], expert_load_NE)
    moe = {**moe, "router_bias": new_bias}
    block = {**params["moe_layers"]["block"], "moe": moe}
    return {**params, "moe_layers": {**params["moe_layers"], "block": block}}


def train_step(cfg, optimizer, state, batch):
    """One optimizer step over `batch` (global batch, split into cfg.train.grad_accum microbatches).
    Non-finite loss or gradients leave params and optimizer state unchanged (counted in metrics)."""
    A = cfg.train.grad_accum
    total_weight = jnp.maximum(jnp.sum(batch["loss_weights"].astype(jnp.float32)), 1.0)
    micro = jax.tree.map(lambda x: x.reshape((A, x.shape[0] // A) + x.shape[1:]), batch)

    def micro_grad(carry, mb):
        grads_acc, = carry
        def f(p):
            terms = loss_terms(cfg, p, mb)
            return total_loss(cfg, terms, total_weight, A), terms
        (loss, terms), grads = jax.value_and_grad(f, has_aux=True)(state["params"])
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc,), (loss, terms)

    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    if A == 1:
        (grads,), (loss, terms) = micro_grad((zeros,), jax.tree.map(lambda x: x[0], micro))
        losses, terms_all = loss[None], jax.tree.map(lambda x: x[None], terms)
    else:
        (grads,), (losses, terms_all) = jax.lax.scan(micro_grad, (zeros,), micro)
    loss = jnp.sum(losses)
    bias_load = jnp.sum(terms_all["expert_load"], axis=0) if "expert_load" in terms_all else None
    # The norm of the params before the step, ordered before the step's in-place update: left free
    # to run after it, XLA copies every parameter on entry to keep the old values (~15 ms a step
    # on the 89M bench).
    param_norm, params = jax.lax.optimization_barrier((optax.global_norm(state["params"]), state["params"]))
    new_params, new_opt, finite, grad_norm = apply_if_finite(
        optimizer, params, state["opt_state"], grads, loss,
        after=None if bias_load is None else (lambda p: _apply_bias_update(cfg, p, bias_load)),
        unrolled=unrolled_stacks(cfg) if A == 1 else ())   # A > 1: the sum's loop makes whole stacks
    new_state = {"params": new_params, "opt_state": new_opt,
                 "step": state["step"] + 1, "rng": jax.random.fold_in(state["rng"], state["step"])}
    nll = jnp.sum(terms_all["nll_sum"]) / total_weight
    metrics = {"loss": loss, "nll": nll, "grad_norm": grad_norm,
               "param_norm": param_norm, "skipped": (~finite).astype(jnp.int32),
               "tokens": total_weight}
    if "expert_load" in terms_all:
        metrics["expert_load"] = jnp.sum(terms_all["expert_load"], axis=0)
        metrics["dropped_fraction"] = jnp.mean(terms_all["dropped_fraction"])
        metrics["load_balance_loss"] = jnp.mean(terms_all["lb_loss"])
    if "mtp_sum" in terms_all:
        metrics.update(mtp_metrics(jnp.sum(terms_all["mtp_sum"], axis=0), jnp.sum(terms_all["mtp_weight"], axis=0)))
    return new_state, metrics


def eval_terms(cfg, params, batch):
    """Summed NLL and weight for held-out evaluation."""
    nll, _, _ = forward_nll(cfg, params, batch)
    w = batch["loss_weights"].astype(jnp.float32)
    return {"nll_sum": jnp.sum(nll * w), "weight": jnp.sum(w)}


def init_state(cfg, optimizer, params, seed: int):
    """Train state dict: params, optimizer state, step, rng."""
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed))}


def init_sharded_state(cfg, optimizer, mesh, params, param_shardings_tree, seed: int):
    """The train state built from `params` (placed by param_shardings_tree) directly in its mesh
    layout: (state, its shardings)."""
    def make(p):
        return init_state(cfg, optimizer, p, seed)
    st_sh = state_shardings(cfg, optimizer, mesh, param_shardings_tree, jax.eval_shape(make, params))
    return jax.jit(make, out_shardings=st_sh)(params), st_sh


def state_shardings(cfg, optimizer, mesh, param_shardings_tree, abstract_state):
    """Shardings of the whole train state: each optimizer leaf whose key path ends with a param's
    path (and has its shape) follows that param (FSDP); everything else is replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path = flatten_by_path(param_shardings_tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    shapes = {k: leaf.shape for k, leaf in flatten_by_path(abstract_state["params"]).items()}

    def one(path, leaf):
        names = key_names(path)
        for start in range(len(names)):
            suffix = names[start:]
            if suffix in by_path and shapes.get(suffix) == getattr(leaf, "shape", None):
                return by_path[suffix]
        return replicated
    opt = jax.tree_util.tree_map_with_path(one, abstract_state["opt_state"])
    return {"params": param_shardings_tree, "opt_state": opt, "step": replicated, "rng": replicated}


def make_train_step(cfg, optimizer, shardings=None, data_sharding=None) -> Any:
    """The jitted train step (state donated). With shardings, state and batch are laid out on the
    mesh (FSDP by the logical rules)."""
    fn = functools.partial(train_step, cfg, optimizer)
    if shardings is None:
        return jax.jit(fn, donate_argnums=(0,))
    batch_sh = {k: data_sharding for k in BATCH_KEYS}
    return jax.jit(fn, in_shardings=(shardings, batch_sh), out_shardings=(shardings, None), donate_argnums=(0,))


def make_eval_step(cfg) -> Any:
    """The jitted eval step."""
    return jax.jit(functools.partial(eval_terms, cfg))
