"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask.

Norm scales, biases and embeddings are not decayed; the router's selection bias is not trained
by the optimizer at all (it moves only by the aux-loss-free update).
"""
from __future__ import annotations

import jax
import optax

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


class TrainOptimizer(optax.GradientTransformationExtraArgs):
    """make_optimizer's transformation. Its `train_cfg` attribute is the `train` section it was
    made from: the fused CPU step (c2jax.backends.cpu.adamw) takes the hyperparameters from there, so
    the optimizer and its fused form cannot disagree."""


def make_optimizer(t) -> TrainOptimizer:
    """The training optimizer from the `train` config section."""
    chain = []
    if t.grad_clip > 0:
        chain.append(optax.clip_by_global_norm(t.grad_clip))
    chain.append(optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=float(t.get("adam_eps", 1e-8)),
                             weight_decay=t.weight_decay, mask=decay_mask))
    tx = optax.multi_transform({"train": optax.chain(*chain), "frozen": optax.set_to_zero()}, frozen_labels)
    out = TrainOptimizer(tx.init, tx.update)
    out.train_cfg = t
    return out
