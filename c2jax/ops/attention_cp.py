"""Attention under context parallelism (the layout of c2jax.parallel.context): each function is a
`jax.shard_map` over the whole mesh, called by c2jax.ops.attention (training) and
c2jax.models.attention (the cache path) when the active mesh has a context axis > 1.
- MLA (`mla_context_attention`): each rank computes its local KV latents (done by the caller),
  all-gathers the small latents (C + R per token, not per-head K/V) and up-projects them
  locally, then attends with its local queries.
- GQA `allgather` (`gqa_context_attention` with impl="allgather"): all-gather K/V, attend.
- GQA `ring`: K/V blocks rotate around the context ring with ppermute; an online softmax
  accumulates the result (per-step logits are L/CP x L/CP).
- Prefill into a KV cache (`gqa_context_prefill`, `mla_context_prefill`, from the cache branch
  of the attention for more than DECODE_MAX_QUERIES tokens per row): all-gather the new K/V or
  latents, write them into the cache (replicated over `context`, as decode expects), attend the
  local queries against the cache.

Letters: B batch, L length (local Lc inside shard_map), S key length, H heads, G kv heads,
P head dim, C kv latent, R rope dims, N nope dims, O value dims, X = N + O.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from c2jax.config import ConfigError
from c2jax.ops.attention_xla import (DECODE_MAX_QUERIES, attention_mask, dot_product_attention,
                                     mla_absorbed_attention, write_cache)
from c2jax.parallel.context import CONTEXT, context_size, cp_active, cp_impl
from c2jax.parallel.mesh import parallel_setting, row_axes, spec_entry

NEG_INF = -1e30


def _token_specs(batch: int, length: int):
    """(batch axes, length axes) shard_map uses for [B, L, ...] activations: the batch axes the
    rules give (the longest prefix dividing B), and `context` for the length."""
    if length % context_size():
        raise ConfigError(f"sequence length {length} is not divisible by the context axis "
                          f"{context_size()}; change the sequence length or mesh.shape")
    return row_axes(batch), (CONTEXT,)


def _spec(b_axes, l_axes, trailing: int):
    return P(spec_entry(b_axes), spec_entry(l_axes), *([None] * trailing))


def _mask(q_pos, k_pos, q_seg, k_seg):
    return (k_pos[:, None, :] <= q_pos[:, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])


def _gather_len(x):
    return jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)


def _query_chunks(length: int) -> int:
    """Number of query chunks (config.mesh.attention_chunk; 1 = one block)."""
    chunk = int(parallel_setting("attention_chunk", 0))
    if chunk <= 0 or chunk >= length:
        return 1
    if length % chunk:
        raise ConfigError(f"mesh.attention_chunk={chunk} must divide the per-rank sequence length {length}")
    return length // chunk


def _map_query_chunks(fn, n: int, *q_args):
    """fn over n chunks of the length dim (axis 1) of q_args; each chunk is rematerialized in the
    backward pass, so only one chunk's logits are live at a time."""
    if n == 1:
        return fn(*q_args)
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]), 1, 0)
    out = jax.lax.map(jax.checkpoint(lambda a: fn(*a)), tuple(split(x) for x in q_args))
    merge = lambda y: jnp.moveaxis(y, 0, 1).reshape(y.shape[1], -1, *y.shape[3:])
    return jax.tree.map(merge, out)

# ----------------------------------------------------------------------------- MLA


def masked_local_attention(q, k_S, v_S, pos, pos_S, seg, seg_S, scale):
    """XLA attention of local queries against gathered keys, masked by position and segment, in
    query chunks (mesh.attention_chunk) so one chunk's logits are live at a time."""
    return _map_query_chunks(lambda qc, pc, sc: dot_product_attention(qc, k_S, v_S, _mask(pc, pos_S, sc, seg_S), scale),
                             _query_chunks(q.shape[1]), q, pos, seg)


def mla_context_attention(q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                          segment_ids_BL, scale: float, dtype, local=masked_local_attention):
    """MLA attention under CP: all-gather latents + rotary keys, up-project locally, attend with
    the local queries. `local(q, k_S, v_S, pos, pos_S, seg, seg_S, scale)` attends one rank's
    queries against the gathered keys (c2jax.ops.attention chooses it). Returns [B, L, H, O]
    sharded like the queries."""
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
        return local(q, k, kv[..., N:], pos, pos_S, seg, seg_S, scale)

    tok = lambda n: _spec(b_axes, l_axes, n)
    fn = jax.shard_map(body, in_specs=(tok(2), tok(2), tok(1), tok(1), P(), tok(0), tok(0)),
                       out_specs=tok(2))
    return fn(q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX.astype(dtype),
              positions_BL, segment_ids_BL)


# ----------------------------------------------------------------------------- GQA


def _ring_update_at(update, kv_blk, qc, pc, sc, mc, dc, ac):
    return update(qc, pc, sc, mc, dc, ac, *kv_blk)


def _ring_attention(q, k, v, pos, seg, scale):
    """Local queries [b, Lc, H, P] against K/V blocks rotated around the context ring; online
    softmax in float32. Every rank's block visits every rank once (cp steps). With
    mesh.attention_chunk, each step updates the queries chunk by chunk."""
    cp = context_size()  # static: read from the mesh at trace time
    b, Lc, H, Pd = q.shape
    G, O = k.shape[2], v.shape[-1]
    n = _query_chunks(Lc)
    m = jnp.full((b, Lc, G, H // G), NEG_INF, jnp.float32)
    den = jnp.zeros((b, Lc, G, H // G), jnp.float32)
    acc = jnp.zeros((b, Lc, G, H // G, O), jnp.float32)
    perm = [(i, (i + 1) % cp) for i in range(cp)]
    k_blk, v_blk, kpos, kseg = k, v, pos, seg

    def update(qc, pc, sc, m, den, acc, k_blk, v_blk, kpos, kseg):
        qg = qc.reshape(qc.shape[0], qc.shape[1], G, H // G, Pd)
        logits = jnp.einsum("blgrp,bsgp->blgrs", qg, k_blk, preferred_element_type=jnp.float32) * scale
        mask = _mask(pc, kpos, sc, kseg)
        logits = jnp.where(mask[:, :, None, None], logits, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        den = den * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("blgrs,bsgo->blgro", p.astype(v_blk.dtype), v_blk,
                                                 preferred_element_type=jnp.float32)
        return m_new, den, acc

    for step in range(cp):
        kv_blk = (k_blk, v_blk, kpos, kseg)
        m, den, acc = _map_query_chunks(functools.partial(_ring_update_at, update, kv_blk),
                                        n, q, pos, seg, m, den, acc)
        if step + 1 < cp:
            k_blk, v_blk, kpos, kseg = jax.lax.ppermute(kv_blk, CONTEXT, perm)
    out = acc / den[..., None]
    return out.reshape(b, Lc, H, O).astype(q.dtype)

def gqa_context_attention(q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL, scale: float,
                          impl: str | None = None, local=masked_local_attention):
    """GQA attention under CP, `impl` "allgather" or "ring" (default: config.mesh.cp_impl).
    allgather: `local` attends the rank's queries against the gathered K/V (see
    mla_context_attention); ring keeps its own XLA online softmax."""
    impl = cp_impl(impl)
    B, L = q_BLHP.shape[:2]
    b_axes, l_axes = _token_specs(B, L)

    def body(q, k, v, pos, seg):
        if impl == "ring":
            return _ring_attention(q, k, v, pos, seg, scale)
        pos_S, seg_S = _gather_len(pos), _gather_len(seg)
        return local(q, _gather_len(k), _gather_len(v), pos, pos_S, seg, seg_S, scale)

    tok = lambda n: _spec(b_axes, l_axes, n)
    fn = jax.shard_map(body, in_specs=(tok(2), tok(2), tok(2), tok(0), tok(0)), out_specs=tok(2))
    return fn(q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL)


# ----------------------------------------------------------------------------- prefill into a KV cache
# Prefill (forward_with_cache with more than DECODE_MAX_QUERIES tokens per row) under CP: the
# tokens are sharded over `context` like in training (zigzag when the caller permutes them, see
# `context_prefill`). Each rank all-gathers the new K/V (MLA: latent + rotary key) and positions
# of the whole chunk, writes them into its copy of the cache (replicated over `context`, sharded
# over the batch axes as in decode: every context rank writes the same entries), and attends its
# local queries against the updated cache, masked by slot position exactly like the single-device
# cache path. Because the keys are the cache, a non-empty cache prefix (chunked prefill, or a
# verify step of a few tokens) is exact too. cp_impl does not apply: the cache needs the gathered
# entries anyway, so there is no ring variant here.


def _cache_spec(b_axes, ndim: int):
    return P(spec_entry(b_axes), *([None] * (ndim - 1)))


def _slots(cache_BS_):
    B, S = cache_BS_.shape[:2]
    return jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))


def gqa_context_prefill(q_BLHP, k_BLGP, v_BLGP, positions_BL, cache_k_BSGP, cache_v_BSGP, scale: float):
    """GQA cache path under CP: returns (out [B, L, H, P] sharded like the queries, new K cache,
    new V cache); the caches equal the single-device `write_cache` results."""
    B, L = q_BLHP.shape[:2]
    b_axes, l_axes = _token_specs(B, L)

    def body(q, k, v, pos, ck, cv):
        pos_S = _gather_len(pos)
        ck = write_cache(ck, _gather_len(k), pos_S)
        cv = write_cache(cv, _gather_len(v), pos_S)
        slots, dt = _slots(ck), q.dtype
        kd, vd = ck.astype(dt), cv.astype(dt)
        out = _map_query_chunks(lambda qc, pc: dot_product_attention(qc, kd, vd, attention_mask(pc, slots), scale),
                                _query_chunks(q.shape[1]), q, pos)
        return out, ck, cv

    tok = lambda n: _spec(b_axes, l_axes, n)
    cache = _cache_spec(b_axes, 4)
    # every context rank writes the same gathered entries, so the caches are replicated over
    # `context`; the all_gather output is typed as varying, hence check_vma=False
    fn = jax.shard_map(body, in_specs=(tok(2), tok(2), tok(2), tok(0), cache, cache),
                       out_specs=(tok(2), cache, cache), check_vma=False)
    return fn(q_BLHP, k_BLGP, v_BLGP, positions_BL, cache_k_BSGP, cache_v_BSGP)


def mla_context_prefill(q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                        cache_latent_BSC, cache_k_rope_BSR, scale: float, dtype):
    """MLA cache path under CP: all-gather the new latents + rotary keys (C + R per token), write
    them into the cache, attend the local queries (absorbed form) against it. Returns
    (out [B, L, H, O] sharded like the queries, new latent cache, new rotary-key cache)."""
    B, L = q_nope_BLHN.shape[:2]
    b_axes, l_axes = _token_specs(B, L)

    def body(q_nope, q_rope, latent, k_rope, kv_b, pos, cl, ckr):
        pos_S = _gather_len(pos)
        cl = write_cache(cl, _gather_len(latent), pos_S)
        ckr = write_cache(ckr, _gather_len(k_rope), pos_S)
        out = _map_query_chunks(
            lambda qn, qr, pc: mla_absorbed_attention(qn, qr, cl, ckr, kv_b, pc, scale, dtype),
            _query_chunks(q_nope.shape[1]), q_nope, q_rope, pos)
        return out, cl, ckr

    tok = lambda n: _spec(b_axes, l_axes, n)
    cache = _cache_spec(b_axes, 3)
    fn = jax.shard_map(body, in_specs=(tok(2), tok(2), tok(1), tok(1), P(), tok(0), cache, cache),
                       out_specs=(tok(2), cache, cache), check_vma=False)
    return fn(q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX.astype(dtype), positions_BL,
              cache_latent_BSC, cache_k_rope_BSR)

def cp_prefill_active(length: int) -> bool:
    """True when a cache-path call of `length` tokens per row runs the CP prefill: CP is active
    and divides the length, and the call is not a decode step (those keep the decode path)."""
    return length > DECODE_MAX_QUERIES and cp_active(length)
