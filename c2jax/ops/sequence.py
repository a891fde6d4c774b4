"""The order a row's tokens take through the model on the active mesh.

Under context parallelism the rows travel in the 2*CP zigzag order (c2jax.parallel.context), so
that contiguous shards of the length dim balance the causal work; elsewhere in token order. The
model asks here instead of looking at the mesh: `token_order` for index arithmetic over the
length dim (the MTP shifts), `prefill_layout` for a cache prefill whose rows it lays out and
restores.

Letters: B batch, L length, S cache slots.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.ops.attention_xla import DECODE_MAX_QUERIES
from c2jax.parallel import context as cpx


def token_order(length: int) -> np.ndarray:
    """order[j]: the token a row of `length` tokens holds at index j under the active mesh (the
    zigzag under context parallelism when 2*CP divides the length, else arange)."""
    cp = cpx.context_size() if cpx.cp_active(length) else 1
    if cp > 1 and length % (2 * cp) == 0:
        return cpx.zigzag_order(length, cp)
    return np.arange(length)


def prefill_layout(tokens_BL, positions_BL, cache_len: int) -> tuple:
    """(tokens, positions, restore) for a cache prefill of [B, L] rows into caches of `cache_len`
    slots. Under an active CP mesh with more than DECODE_MAX_QUERIES tokens after padding: rows
    padded to a multiple of 2*CP (pad tokens at position cache_len, whose cache writes are
    dropped and which no real query sees) and zigzag-permuted, so the attention takes its CP
    prefill path; restore(x, axis) puts a per-token output back in token order and drops the
    padding. Elsewhere the rows as given and restore is the identity."""
    tokens_BL = jnp.asarray(tokens_BL, jnp.int32)
    positions_BL = jnp.asarray(positions_BL, jnp.int32)
    L = tokens_BL.shape[1]
    cp = cpx.context_size()
    identity: Callable = lambda x, axis=1: x  # noqa: E731
    if cp <= 1 or not cpx.cp_active():
        return tokens_BL, positions_BL, identity
    Lp = -(-L // (2 * cp)) * (2 * cp)
    if Lp <= DECODE_MAX_QUERIES:
        return tokens_BL, positions_BL, identity
    if Lp > L:
        tokens_BL = jnp.pad(tokens_BL, ((0, 0), (0, Lp - L)))
        positions_BL = jnp.pad(positions_BL, ((0, 0), (0, Lp - L)), constant_values=cache_len)
    tokens_BL, positions_BL = cpx.zigzag_permute((tokens_BL, positions_BL), cp)

    def restore(x, axis: int = 1):
        """x in token order along `axis`, the padding dropped."""
        return jax.lax.slice_in_dim(cpx.zigzag_unpermute(x, cp, axis=axis), 0, L, axis=axis)
    return tokens_BL, positions_BL, restore
