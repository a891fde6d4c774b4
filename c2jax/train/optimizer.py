"""The training optimizer: AdamW with linear warmup + cosine decay, global-norm clipping and a
weight-decay mask, computed by the implementation `train.optimizer` chooses (c2jax.ops.optimizer:
"auto", "optax_adamw" or "cpu_fused_adamw").

Norm scales, biases and embeddings are not decayed; the router's selection bias is not trained
by the optimizer at all (it moves only by the aux-loss-free update).
"""
from __future__ import annotations

import jax
import optax

from c2jax.ops.optimizer import AdamW, FusedAdamW, TrainOptimizer, make  # noqa: F401 (FusedAdamW re-exported)
from c2jax.treepath import key_names


def decay_mask(params):
    """True where weight decay applies (matrices), False for norms, biases, embeddings."""
    def one(path, leaf):
        names = key_names(path)
        return not ({"scale", "bias", "router_bias", "embed"} & set(names))
    return jax.tree_util.tree_map_with_path(one, params)


def frozen_labels(params):
    """'frozen' for leaves the optimizer must not touch (the router selection bias)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if "router_bias" in key_names(path) else "train", params)


def learning_rate_schedule(t) -> optax.Schedule:
    """Linear warmup to t.lr, cosine decay to t.lr * t.min_lr_ratio at t.steps."""
    warmup = max(int(t.warmup_steps), 0)
    decay_steps = max(int(t.steps) - warmup, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else t.lr, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=warmup + decay_steps, end_value=t.lr * t.min_lr_ratio)


def adamw_of(t) -> AdamW:
    """The AdamW definition of the `train` config section."""
    return AdamW(learning_rate=learning_rate_schedule(t), b1=float(t.b1), b2=float(t.b2),
                 eps=float(t.get("adam_eps", 1e-8)), weight_decay=float(t.weight_decay), grad_clip=float(t.grad_clip),
                 decay_mask=decay_mask, frozen_labels=frozen_labels)


def make_optimizer(t, target=None, params=None) -> TrainOptimizer:
    """The training optimizer from the `train` config section, as the implementation
    t.optimizer names ("auto": the first that runs on `target`, default
    c2jax.ops.current_target(), and on `params`' dtypes when given; pass the step's target,
    target_of_mesh(mesh), when the optimizer is made outside the step's mesh)."""
    return make(t.get("optimizer", "auto"), adamw_of(t), target, params)
