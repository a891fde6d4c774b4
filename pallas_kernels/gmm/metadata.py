"""Tile-visit schedule shared by the gmm/tgmm kernels and the XLA scan fallback (megablox-style)."""
# Dim letters: M rows, G groups, V visits (row tile x group pairs, static bound tiles_m + G - 1).
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class Visits(NamedTuple):
    """Per-visit group id (G = none), row-tile id, first-visit-of-tile flag, group row bounds."""
    gid_V: jnp.ndarray
    mtile_V: jnp.ndarray
    first_V: jnp.ndarray
    starts_G1: jnp.ndarray  # row start per group, plus a trailing empty sentinel group
    ends_G1: jnp.ndarray
    sizes_G: jnp.ndarray    # group sizes clamped so that they end by M


def make_visits(group_sizes_G, m: int, m_pad: int, tm: int) -> Visits:
    """Visit every (row tile, group overlapping it) pair in order, then every tile no group covers."""
    g = group_sizes_G.shape[0]
    tiles_m = m_pad // tm
    nv = tiles_m + g - 1
    gs = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), m)
    starts = jnp.minimum(jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), m)
    sizes = ends - starts
    total = ends[-1]
    t0 = starts // tm
    t1 = (ends + tm - 1) // tm
    n_g = jnp.where(sizes > 0, t1 - t0, 0)
    voff = jnp.cumsum(n_g) - n_g
    n_used = jnp.sum(n_g)
    v = jnp.arange(nv, dtype=jnp.int32)
    gid = jnp.repeat(jnp.arange(g, dtype=jnp.int32), n_g, total_repeat_length=nv)
    mt = t0[gid] + v - voff[gid]
    tail = v >= n_used
    tail_start = (total + tm - 1) // tm
    mt = jnp.where(tail, jnp.minimum(tail_start + v - n_used, tiles_m - 1), mt).astype(jnp.int32)
    gid = jnp.where(tail, g, gid).astype(jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), jnp.int32), (mt[1:] != mt[:-1]).astype(jnp.int32)])
    starts_g1 = jnp.concatenate([starts, total[None]]).astype(jnp.int32)
    ends_g1 = jnp.concatenate([ends, total[None]]).astype(jnp.int32)
    return Visits(gid, mt, first, starts_g1, ends_g1, sizes)
