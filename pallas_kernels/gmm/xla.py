"""XLA fallback for gmm/tgmm: a scan over (row tile, group) visits, each a dense [tm,K]x[K,N] matmul.

On CPU, jax.lax.ragged_dot lowers to a dense masked product (G times the FLOPs); this costs
(M + G*tm) * K * N instead.
"""
# Dim letters: M rows, K contraction, N output, G groups, V visits, T tile rows (tm).
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import pad_axis, round_up, varying_zeros
from pallas_kernels.gmm.metadata import make_visits


def gmm_xla(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=jnp.float32,
            transpose_rhs=False, tm=128):
    """Grouped matmul via a scan over visits (rhs is [G,N,K] when transpose_rhs)."""
    m = lhs_MK.shape[0]
    g = rhs_GKN.shape[0]
    n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
    tm = min(tm, round_up(m, 8))
    m_pad = round_up(m, tm)
    lhs_p = pad_axis(lhs_MK, 0, m_pad)
    vis = make_visits(group_sizes_G, m, m_pad, tm)

    def body(out_MN, xs):
        gid, mt = xs
        x_TK = jax.lax.dynamic_slice_in_dim(lhs_p, mt * tm, tm, 0)
        w = rhs_GKN[jnp.minimum(gid, g - 1)]
        dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        y_TN = jax.lax.dot_general(x_TK, w, dims, preferred_element_type=jnp.float32)
        rows_T = mt * tm + jnp.arange(tm)
        mask_T = (rows_T >= vis.starts_G1[gid]) & (rows_T < vis.ends_G1[gid])
        cur_TN = jax.lax.dynamic_slice_in_dim(out_MN, mt * tm, tm, 0)
        new_TN = jnp.where(mask_T[:, None], y_TN, cur_TN)
        return jax.lax.dynamic_update_slice_in_dim(out_MN, new_TN, mt * tm, 0), None

    out0 = varying_zeros((m_pad, n), jnp.float32, lhs_MK, rhs_GKN, group_sizes_G)  # carry: shard_map-safe
    out, _ = jax.lax.scan(body, out0, (vis.gid_V, vis.mtile_V))
    return out[:m].astype(preferred_element_type)


def tgmm_xla(lhs_MK, dy_MN, group_sizes_G, *, preferred_element_type=jnp.float32, tm=128):
    """out[g] = lhs[rows of g]^T @ dy[rows of g] -> [G,K,N] via a scan over visits."""
    m, k = lhs_MK.shape
    n = dy_MN.shape[1]
    g = group_sizes_G.shape[0]
    tm = min(tm, round_up(m, 8))
    m_pad = round_up(m, tm)
    lhs_p = pad_axis(lhs_MK, 0, m_pad)
    dy_p = pad_axis(dy_MN, 0, m_pad)
    vis = make_visits(group_sizes_G, m, m_pad, tm)

    def body(acc_GKN, xs):
        gid, mt = xs
        rows_T = mt * tm + jnp.arange(tm)
        mask_T = ((rows_T >= vis.starts_G1[gid]) & (rows_T < vis.ends_G1[gid]))[:, None]
        x_TK = jnp.where(mask_T, jax.lax.dynamic_slice_in_dim(lhs_p, mt * tm, tm, 0), 0)
        d_TN = jnp.where(mask_T, jax.lax.dynamic_slice_in_dim(dy_p, mt * tm, tm, 0), 0)
        upd_KN = jax.lax.dot_general(x_TK, d_TN, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
        gc = jnp.minimum(gid, g - 1)
        return acc_GKN.at[gc].add(upd_KN), None

    acc0 = varying_zeros((g, k, n), jnp.float32, lhs_MK, dy_MN, group_sizes_G)
    out, _ = jax.lax.scan(body, acc0, (vis.gid_V, vis.mtile_V))
    return out.astype(preferred_element_type)
