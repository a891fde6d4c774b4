"""The row state of the sampler's slots and the prefill both kernel sets share.

c2jax.sampling.engine (plain decoding) and c2jax.sampling.speculative (MTP drafts) build their
jitted kernels on these; both import this module and neither imports the other's kernels.

Letters: B slots, S cache slots per row, b prefill rows, L prefill length, M fan-out rows,
P cached positions of a row window, X stop ids per row, V vocab, N MoE layers.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from c2jax.sampling import logits as lg
from c2jax.sampling import unrolled

FINISH = {0: "", 1: "stop", 2: "length", 3: "max_len"}
MAX_STOP_IDS = 8


class RowState(NamedTuple):
    """Device state of every slot (arrays of leading size B)."""

    cur: jax.Array        # int32 pending token (not yet in the cache)
    pos: jax.Array        # int32 tokens in the cache (= position of `cur`)
    live: jax.Array       # bool: the next step consumes `cur`
    done: jax.Array       # bool: the next step only flushes (no new token)
    ngen: jax.Array       # int32 tokens generated so far
    max_new: jax.Array    # int32
    temp: jax.Array       # f32
    top_k: jax.Array      # int32
    top_p: jax.Array      # f32
    key: jax.Array        # typed PRNG key per row
    stop: jax.Array       # int32 [B, X] stop ids (-1 padded)
    reason: jax.Array     # int32 FINISH code


def init_row_state(B: int) -> RowState:
    """Every slot idle (not live), with neutral sampling settings."""
    z = lambda dt=jnp.int32: jnp.zeros((B,), dt)
    return RowState(cur=z(), pos=z(), live=z(bool), done=z(bool), ngen=z(), max_new=z(),
                    temp=jnp.ones((B,), jnp.float32), top_k=z(), top_p=jnp.ones((B,), jnp.float32),
                    key=jax.random.split(jax.random.key(0), B), stop=jnp.full((B, MAX_STOP_IDS), -1, jnp.int32),
                    reason=z())


def finish_codes(tok, ngen, pos_of_tok, max_new, stop, S):
    """FINISH code per row after emitting `tok` (its ngen-th token, at position pos_of_tok):
    1 stop id, 2 max_new reached, 3 cache end, 0 not finished."""
    is_stop = jnp.any(tok[:, None] == stop, axis=-1)
    hit_len = ngen >= max_new
    hit_cache = pos_of_tok >= S - 1
    code = jnp.where(is_stop, 1, jnp.where(hit_len, 2, jnp.where(hit_cache, 3, 0))).astype(jnp.int32)
    return code


# ----------------------------------------------------------------------------- prefill


def prefill_rows(step, N, S, cache, state, tokens_bL, start_b, len_b, src_slot_b, dest_slot_M, dest_src_M,
                 seed_M, rid_M, sidx_M, max_new_M, temp_M, top_k_M, top_p_M, stop_MX, use_filter):
    """The prefill both kernel sets share (inside their jit): run `step(tokens, positions, cache)
    -> (out, extra)` on the source slots' caches (b prompt suffixes; padding at position S),
    copy the new caches into the M destination slots, sample each destination row's first token
    and write its RowState. Returns (cache, state, (tok, lp, raw, code, experts), (out, extra), key0)."""
    rows = jax.tree.map(lambda c: c[:, src_slot_b], cache)
    new_rows, upd, outs, (out, extra), key0 = prefill_compute(
        step, N, S, rows, tokens_bL, start_b, len_b, dest_src_M, seed_M, rid_M, sidx_M, max_new_M, temp_M,
        top_k_M, top_p_M, stop_MX, use_filter)
    cache, state = write_rows(cache, state, new_rows, upd, dest_slot_M, dest_src_M)
    return cache, state, outs, (out, extra), key0


def prefill_compute(step, N, S, rows, tokens_bL, start_b, len_b, dest_src_M, seed_M, rid_M, sidx_M, max_new_M,
                    temp_M, top_k_M, top_p_M, stop_MX, use_filter):
    """prefill_rows' work on the b source rows' caches `rows` alone: returns (new b-row caches,
    RowState of the M destination rows, (tok, lp, raw, code, experts), (out, extra), key0)."""
    b, L = tokens_bL.shape
    ar = jnp.arange(L, dtype=jnp.int32)
    positions = jnp.where(ar[None] < len_b[:, None], start_b[:, None] + ar[None], S)
    out, extra = step(tokens_bL, positions, rows)
    last_bV = out.logits[jnp.arange(b), jnp.maximum(len_b - 1, 0)]
    base = lg.row_keys(seed_M, rid_M, sidx_M)
    key0 = lg.step_keys(base, jnp.zeros_like(sidx_M))
    tok, lp, raw = lg.select_tokens(last_bV[dest_src_M], key0, temp_M, top_k_M, top_p_M, use_filter)
    pos_M = (start_b + len_b)[dest_src_M]
    one = jnp.ones_like(pos_M)
    code = finish_codes(tok, one, pos_M, max_new_M, stop_MX, S)
    upd = RowState(cur=tok, pos=pos_M, live=jnp.ones_like(pos_M, bool), done=code > 0, ngen=one,
                   max_new=max_new_M, temp=temp_M, top_k=top_k_M, top_p=top_p_M, key=base, stop=stop_MX,
                   reason=code)
    experts = out.aux["expert_ids"] if N else None
    return out.cache, upd, (tok, lp, raw, code, experts), (out, extra), key0


def write_rows(cache, state, new_rows, upd, dest_slot_M, dest_src_M):
    """Destination slot dest_slot_M[k] (B: none) gets source row dest_src_M[k]'s new cache and
    RowState upd[k]. new_rows (stacked [Y, b, P, ...]) may hold only positions [0, P) of each
    row: the rest of the destination row is left as it is (stale entries past a row's position
    are masked). cache: stacked, or per layer (the split decode's list, unrolled.split_cache)."""
    P = jax.tree.leaves(new_rows)[0].shape[2]
    if isinstance(cache, list):
        cache = [jax.tree.map(lambda c, n: c.at[dest_slot_M, :P].set(n[dest_src_M], mode="drop"), layer, new)
                 for layer, new in zip(cache, unrolled.split_cache(new_rows))]
    else:
        cache = jax.tree.map(lambda c, n: c.at[:, dest_slot_M, :P].set(n[:, dest_src_M], mode="drop"), cache, new_rows)
    state = jax.tree.map(lambda s, u: s.at[dest_slot_M].set(u, mode="drop"), state, upd)
    return cache, state
