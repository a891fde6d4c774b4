"""Context parallelism (CP): the sequence is sharded over the `context` mesh axis.

Layout: the 2*CP zigzag causal load balance. A row of L tokens is cut into 2*CP chunks and CP
rank i holds chunks i and 2*CP-1-i, so every rank owns as many early (cheap) as late
(expensive) causal queries. `zigzag_permute` reorders tokens, positions, segment ids, targets
and masks consistently *before* the model; after that, contiguous sharding of the length dim
over `context` gives each rank its two chunks. Attention masks by position and segment id,
so the permuted sequence computes exactly the same values (packed segments included).

This module holds the layout and whether CP is on (`cp_active`, `context_size`, `cp_impl`);
the attention that runs under it (MLA latent all-gather, GQA ring / all-gather, prefill into a
KV cache) is an implementation of the attention ops: c2jax.ops.attention_cp.
c2jax.ops.sequence lays rows out in this order for the model (MTP shifts, cache prefill).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.config import ConfigError
from c2jax.parallel.mesh import active_axis_sizes, active_logical_axes, parallel_setting

CONTEXT = "context"


# ----------------------------------------------------------------------------- zigzag layout


def zigzag_order(length: int, cp: int) -> np.ndarray:
    """Index array: permuted[j] = original[order[j]]. Rank i's contiguous slice of the permuted
    sequence is chunk i followed by chunk 2*cp-1-i of the original."""
    if cp <= 1:
        return np.arange(length)
    if length % (2 * cp):
        raise ConfigError(f"sequence length {length} is not divisible by 2*CP = {2 * cp} (context axis "
                          f"{cp}); change train.seq_len or the context size in mesh.shape")
    chunk = length // (2 * cp)
    chunks = np.arange(length).reshape(2 * cp, chunk)
    order = [np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)]
    return np.concatenate(order)


def zigzag_permute(tree, cp: int, axis: int = 1):
    """Apply the zigzag order along `axis` (the length dim) to every array in `tree`."""
    def one(x):
        if x is None:
            return None
        return jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], cp)), axis=axis)
    return jax.tree.map(one, tree)


def zigzag_unpermute(tree, cp: int, axis: int = 1):
    """Inverse of `zigzag_permute` (e.g. to compare logits with an unsharded run)."""
    def one(x):
        if x is None:
            return None
        inv = np.argsort(zigzag_order(x.shape[axis], cp))
        return jnp.take(x, jnp.asarray(inv), axis=axis)
    return jax.tree.map(one, tree)


# ----------------------------------------------------------------------------- activation


def context_size() -> int:
    """Size of the active mesh's context axis (1 outside a mesh)."""
    return active_axis_sizes().get(CONTEXT, 1)

def cp_impl(impl: str | None = None) -> str:
    """The GQA context layout: `impl` or config.mesh.cp_impl ("allgather" | "ring")."""
    impl = impl or parallel_setting("cp_impl", "allgather")
    if impl not in ("allgather", "ring"):
        raise ConfigError(f"mesh.cp_impl = {impl!r}; choose 'allgather' or 'ring'")
    return impl

def cp_active(length: int | None = None) -> bool:
    """True when the active mesh shards the sequence over a context axis > 1 (and, given the
    length, when the context axis divides it; otherwise GSPMD runs the unsharded attention,
    e.g. for the dummy batch of a shape-only init)."""
    cp = context_size()
    if cp <= 1 or CONTEXT not in active_logical_axes("length"):
        return False
    return length is None or length % cp == 0


__all__ = [
    "CONTEXT",
    "context_size",
    "cp_active",
    "cp_impl",
    "zigzag_order",
    "zigzag_permute",
    "zigzag_unpermute",
]
