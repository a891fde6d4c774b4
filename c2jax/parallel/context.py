"""Context parallelism (CP): the sequence is sharded over the `context` mesh axis.

Layout: the 2*CP zigzag causal load balance. A row of L tokens is cut into 2*CP chunks and CP
rank i holds chunks i and 2*CP-1-i, so every rank owns as many early (cheap) as late
(expensive) causal queries. `zigzag_permute` reorders tokens, positions, segment ids, targets
and masks consistently *before* the model; after that, contiguous sharding of the length dim
over `context` gives each rank its two chunks. Attention masks by position and segment id,
so the permuted sequence computes exactly the same values (packed segments included).

Attention inside the model (called from c2jax.models.attention when the active mesh has a
context axis > 1), each a `jax.shard_map` over the whole mesh:
- MLA (`mla_context_attention`): each rank computes its local KV latents (done by the caller),
  all-gathers the small latents (C + R per token, not per-head K/V) and up-projects them
  locally, then attends with its local queries.
- GQA `allgather` (`gqa_context_attention` with impl="allgather"): all-gather K/V, attend.
- GQA `ring`: K/V blocks rotate around the context ring with ppermute; an online softmax
  accumulates the result (per-step logits are L/CP x L/CP).

Letters: B batch, L length (local Lc inside shard_map), S key length, H heads, G kv heads,
P head dim, C kv latent, R rope dims, N nope dims, O value dims, X = N + O.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from c2jax.config import ConfigError
from c2jax.parallel.mesh import (active_axis_sizes, active_logical_axes, axes_size, divisible_axes,
                                 parallel_setting, spec_entry)

CONTEXT = "context"
NEG_INF = -1e30


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


def _token_specs(batch: int, length: int):
    """(batch axes, length axes) shard_map uses for [B, L, ...] activations: the batch axes the
    rules give (the longest prefix dividing B), and `context` for the length."""
    if length % context_size():
        raise ConfigError(f"sequence length {length} is not divisible by the context axis "
                          f"{context_size()}; change the sequence length or mesh.shape")
    b_axes = tuple(a for a in active_logical_axes("batch") if a != CONTEXT)
    return divisible_axes(batch, b_axes), (CONTEXT,)


def _spec(b_axes, l_axes, trailing: int):
    return P(spec_entry(b_axes), spec_entry(l_axes), *([None] * trailing))


def _mask(q_pos, k_pos, q_seg, k_seg):
    return (k_pos[:, None, :] <= q_pos[:, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])


def _gather_len(x):
    return jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)


# ----------------------------------------------------------------------------- MLA


def mla_context_attention(q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                          segment_ids_BL, scale: float, dtype):
    """MLA attention under CP: all-gather latents + rotary keys, up-project locally, attend with
    the local queries. Returns [B, L, H, O] sharded like the queries."""
    from c2jax.models.attention import dot_product_attention
    B, L, H, N = q_nope_BLHN.shape
    b_axes, l_axes = _token_specs(B, L)

    def body(q_nope, q_rope, latent, k_rope, kv_b, pos, seg):
        # the latent gather is independent of the query path, so XLA can overlap it
        latent_S = _gather_len(latent)
        k_rope_S = _gather_len(k_rope)
        pos_S, seg_S = _gather_len(pos), _gather_len(seg)
        kv = jnp.einsum("bsc,chx->bshx", latent_S, kv_b)
        b, S = kv.shape[:2]
        k = jnp.concatenate([kv[..., :N], jnp.broadcast_to(k_rope_S[:, :, None], (b, S, H, k_rope_S.shape[-1]))], -1)
        q = jnp.concatenate([q_nope, q_rope], -1)
        return dot_product_attention(q, k, kv[..., N:], _mask(pos, pos_S, seg, seg_S), scale)

    tok = lambda n: _spec(b_axes, l_axes, n)  # noqa: E731
    fn = jax.shard_map(body, in_specs=(tok(2), tok(2), tok(1), tok(1), P(), tok(0), tok(0)),
                       out_specs=tok(2))
    return fn(q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX.astype(dtype),
              positions_BL, segment_ids_BL)


# ----------------------------------------------------------------------------- GQA


def _ring_attention(q, k, v, pos, seg, scale):
    """Local queries [b, Lc, H, P] against K/V blocks rotated around the context ring; online
    softmax in float32. Every rank's block visits every rank once (cp steps)."""
    cp = context_size()  # static: read from the mesh at trace time
    b, Lc, H, Pd = q.shape
    G = k.shape[2]
    qg = q.reshape(b, Lc, G, H // G, Pd)
    m = jnp.full((b, G, H // G, Lc), NEG_INF, jnp.float32)
    den = jnp.zeros((b, G, H // G, Lc), jnp.float32)
    acc = jnp.zeros((b, G, H // G, Lc, v.shape[-1]), jnp.float32)
    perm = [(i, (i + 1) % cp) for i in range(cp)]
    k_blk, v_blk, kpos, kseg = k, v, pos, seg
    for step in range(cp):
        logits = jnp.einsum("blgrp,bsgp->bgrls", qg, k_blk, preferred_element_type=jnp.float32) * scale
        mask = _mask(pos, kpos, seg, kseg)
        logits = jnp.where(mask[:, None, None], logits, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        den = den * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("bgrls,bsgo->bgrlo", p.astype(v_blk.dtype), v_blk,
                                                 preferred_element_type=jnp.float32)
        m = m_new
        if step + 1 < cp:
            k_blk, v_blk, kpos, kseg = jax.lax.ppermute((k_blk, v_blk, kpos, kseg), CONTEXT, perm)
    out = acc / den[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, Lc, H, v.shape[-1]).astype(q.dtype)


def gqa_context_attention(q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL, scale: float,
                          impl: str | None = None):
    """GQA attention under CP, `impl` "allgather" or "ring" (default: config.mesh.cp_impl)."""
    from c2jax.models.attention import dot_product_attention
    impl = impl or parallel_setting("cp_impl", "allgather")
    if impl not in ("allgather", "ring"):
        raise ConfigError(f"mesh.cp_impl = {impl!r}; choose 'allgather' or 'ring'")
    B, L = q_BLHP.shape[:2]
    b_axes, l_axes = _token_specs(B, L)

    def body(q, k, v, pos, seg):
        if impl == "ring":
            return _ring_attention(q, k, v, pos, seg, scale)
        pos_S, seg_S = _gather_len(pos), _gather_len(seg)
        return dot_product_attention(q, _gather_len(k), _gather_len(v), _mask(pos, pos_S, seg, seg_S), scale)

    tok = lambda n: _spec(b_axes, l_axes, n)  # noqa: E731
    fn = jax.shard_map(body, in_specs=(tok(2), tok(2), tok(2), tok(0), tok(0)), out_specs=tok(2))
    return fn(q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL)


def cp_active(length: int | None = None) -> bool:
    """True when the active mesh shards the sequence over a context axis > 1 (and, given the
    length, when the context axis divides it; otherwise GSPMD runs the unsharded attention,
    e.g. for the dummy batch of a shape-only init)."""
    cp = context_size()
    if cp <= 1 or CONTEXT not in active_logical_axes("length"):
        return False
    return length is None or length % cp == 0


__all__ = ["zigzag_order", "zigzag_permute", "zigzag_unpermute", "context_size", "cp_active",
           "mla_context_attention", "gqa_context_attention", "axes_size"]
