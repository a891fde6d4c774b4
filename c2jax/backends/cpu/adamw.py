"""AdamW's step as one in-place FFI pass per leaf on CPU (c2jax/backends/cpu/cpu_adamw.cc), with
the finiteness gate inside: the arithmetic of c2jax.ops.optimizer's cpu_fused_adamw.

Why: XLA CPU runs optax's AdamW as three fusions per leaf (new mu, new nu, then the parameter
from both), ~10 passes over the parameter-sized arrays, and apply_if_finite's cond copies every
parameter on entry so the branch can write the donated buffers: ~0.3 s of a 2.6 s step on the
89M bench. The kernel reads p, g, m, v once and writes p, m, v in place (7 passes), and a step
with non-finite loss or gradients returns at once, leaving params and state as they were.

Same arithmetic as optax (clip_by_global_norm -> scale_by_adam -> masked add_decayed_weights ->
scale_by_learning_rate -> apply_updates, in that order, float32) on the state tree of
c2jax.ops.optimizer.optax_adamw; frozen leaves (the router's selection bias) are not touched, as
under optax.multi_transform's set_to_zero. The AdamW definition `a` (c2jax.ops.optimizer.AdamW)
gives the hyperparameters, the learning-rate schedule and the decay / frozen masks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.treepath import flatten_by_path, key_names

_STATES = (optax.ScaleByAdamState, optax.ScaleByScheduleState)


def _find_states(opt_state):
    found = {}

    def visit(x):
        if isinstance(x, _STATES):
            found.setdefault(type(x), []).append(x)
        return x
    jax.tree.map(visit, opt_state, is_leaf=lambda x: isinstance(x, _STATES))
    return found


def state_unusable(opt_state) -> str | None:
    """Why `opt_state` is not a state the kernel steps (None when it is): the state of
    c2jax.ops.optimizer.optax_adamw with float32 moments."""
    found = _find_states(opt_state)
    if [len(found.get(t, [])) for t in _STATES] != [1, 1]:
        return "the optimizer state is not AdamW's (c2jax.ops.optimizer.optax_adamw's init)"
    adam = found[optax.ScaleByAdamState][0]
    if any(leaf.dtype != jnp.float32 for leaf in jax.tree.leaves((adam.mu, adam.nu))):
        return "the Adam moments are not float32"
    return None


def _leaf_step(p, g, m, v, coef, a, wd, offset=0):
    """(p, m, v) with elements [offset, offset + g.size) stepped by g, in place."""
    return jax.ffi.ffi_call(
        cpu_kernels.ADAMW, tuple(jax.ShapeDtypeStruct(p.shape, jnp.float32) for _ in range(3)),
        input_output_aliases={0: 0, 2: 1, 3: 2}, vmap_method="sequential")(
        p, g, m, v, coef, b1=np.float64(a.b1), b2=np.float64(a.b2), eps=np.float64(a.eps), wd=np.float64(wd),
        offset=np.int64(offset))


def layers_of(path, g, unrolled=()) -> list:
    """The gradient of a leaf of an unrolled stack (path under one of `unrolled`, names from
    transformer.unrolled_stacks) as its layers, else [g].

    Why: the backward of unrolled layers produces each layer's gradient separately and XLA
    concatenates them into the stacked leaf (~40 ms a step on the 89M bench); read through static
    per-layer slices, XLA's simplifier takes each slice from the concatenation's operand, and the
    concatenation is never made. (A scan's loop writes the stacked gradient in place: slices of it
    would be copies, so other stacks stay whole.)"""
    if path and path[0] in unrolled and g.ndim >= 2:
        return [g[i] for i in range(g.shape[0])]
    return [g]


def global_norm(grads, unrolled=()):
    """optax.global_norm(grads), with the leaves of `unrolled` stacks summed layer by layer."""
    return _flat_norm(flatten_by_path(grads), unrolled)


def _flat_norm(g_flat, unrolled):
    sq = [jnp.sum(jnp.square(piece.astype(jnp.float32)))
          for path, g in g_flat.items() for piece in layers_of(path, g, unrolled)]
    return jnp.sqrt(sum(sq))


def apply(a, params, opt_state, grads, finite, grad_norm=None, unrolled=()):
    """(new params, new optimizer state) of AdamW `a` for these grads, or the old ones where
    `finite` is False. `grad_norm`: the norm of all of `grads`, if already computed (the clip's
    norm over the trained leaves is then that one when no leaf is frozen). `unrolled`: the stacks
    whose gradients are read layer by layer (layers_of)."""
    why = state_unusable(opt_state)
    if why:
        raise ValueError(f"the fused AdamW step cannot step this state: {why}; build the state with the "
                         f"optimizer's own init")
    found = _find_states(opt_state)
    adam, sched = found[optax.ScaleByAdamState][0], found[optax.ScaleByScheduleState][0]
    labels, decay = a.frozen_labels(params), a.decay_mask(params)
    train = {k for k, lab in flatten_by_path(labels).items() if lab == "train"}
    g_flat = flatten_by_path(grads)
    if grad_norm is not None and len(train) == len(g_flat):
        g_norm = grad_norm
    else:
        g_norm = _flat_norm({k: g_flat[k] for k in sorted(train)}, unrolled)
    count_inc = numerics.safe_increment(adam.count)
    clip = a.grad_clip > 0
    coef = jnp.stack([  # the kernel's coef (cpu_adamw.cc); optax clips unless g_norm < max_norm
        finite, (g_norm >= a.grad_clip) if clip else False, g_norm, a.grad_clip if clip else 1.0,
        1 - a.b1 ** count_inc, 1 - a.b2 ** count_inc, -1 * a.learning_rate(sched.count),
    ]).astype(jnp.float32)
    p_flat, m_flat, v_flat = flatten_by_path(params), flatten_by_path(adam.mu), flatten_by_path(adam.nu)
    d_flat = flatten_by_path(decay)
    new_p, new_m, new_v = {}, {}, {}
    for k in p_flat:
        if k not in train:
            new_p[k] = p_flat[k]
            continue
        p, m, v, offset = p_flat[k], m_flat[k], v_flat[k], 0
        for g in layers_of(k, g_flat[k], unrolled):   # a chain of in-place steps over a stack's layers
            p, m, v = _leaf_step(p, g, m, v, coef, a, a.weight_decay if d_flat[k] else 0.0, offset)
            offset += g.size
        new_p[k], new_m[k], new_v[k] = p, m, v

    def rebuild(tree, new):
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: new.get(key_names(path), leaf), tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))

    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731 (scalars only)
    new_adam = optax.ScaleByAdamState(count=keep(count_inc, adam.count), mu=rebuild(adam.mu, new_m),
                                      nu=rebuild(adam.nu, new_v))
    new_sched = optax.ScaleByScheduleState(count=keep(numerics.safe_increment(sched.count), sched.count))
    new_state = jax.tree.map(lambda x: {optax.ScaleByAdamState: new_adam, optax.ScaleByScheduleState: new_sched}
                             .get(type(x), x), opt_state, is_leaf=lambda x: isinstance(x, _STATES))
    return rebuild(params, new_p), new_state
