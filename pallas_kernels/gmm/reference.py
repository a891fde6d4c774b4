"""Pure-jnp grouped matmul references: jax.lax.ragged_dot is the oracle."""
# Dim letters: M rows (tokens sorted by group), K contraction, N output, G groups (experts).
from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm_reference(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=jnp.float32):
    """out[m] = lhs[m] @ rhs[group(m)]; rows past sum(group_sizes) are zero."""
    return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                              preferred_element_type=preferred_element_type)


def group_ids_M(group_sizes_G, m: int):
    """Group index of every row (G for rows past the last group)."""
    ends_G = jnp.cumsum(group_sizes_G.astype(jnp.int32))
    return jnp.searchsorted(ends_G, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def tgmm_reference(lhs_MK, dy_MN, group_sizes_G, preferred_element_type=jnp.float32):
    """out[g] = lhs[rows of g]^T @ dy[rows of g] -> [G, K, N] (masked one-hot einsum)."""
    g = group_sizes_G.shape[0]
    onehot_MG = (group_ids_M(group_sizes_G, lhs_MK.shape[0])[:, None] == jnp.arange(g)[None, :])
    return jnp.einsum("mk,mg,mn->gkn", lhs_MK.astype(jnp.float32), onehot_MG.astype(jnp.float32),
                      dy_MN.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST).astype(preferred_element_type)
