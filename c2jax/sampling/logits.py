"""Token selection from logits: temperature, top-k, top-p, greedy, with per-row parameters
and per-row PRNG keys (so a row's token depends only on its own logits and key).

Letters: B rows, V vocab.

Log-probabilities returned for each chosen token:
  behaviour: log-prob under the distribution actually sampled from (logits / temperature,
             restricted to the top-k / top-p set and renormalized). This is the one an
             off-policy correction (importance ratio) needs. Greedy rows (temperature 0)
             sample from a point mass: behaviour logprob 0.
  raw:       log_softmax of the unmodified logits (temperature 1, no filtering), the number
             the trainer's forward reproduces.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(scaled_BV, top_k_B, top_p_B):
    """Mask (to -inf) tokens outside each row's top-k (0 = off) and top-p (1.0 = off) set.
    Ties at the threshold are all kept. The top-p set is the smallest prefix of the
    top-k-restricted, renormalized, descending distribution whose mass reaches top_p."""
    V = scaled_BV.shape[-1]
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
    rank_V = jnp.arange(V, dtype=jnp.int32)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V).astype(jnp.int32)
    in_k_BV = rank_V[None, :] < k_B[:, None]
    probs_BV = jax.nn.softmax(jnp.where(in_k_BV, sorted_BV, -jnp.inf), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = in_k_BV & (mass_before_BV < top_p_B[:, None])
    n_keep_B = jnp.maximum(jnp.sum(keep_BV, axis=-1), 1)
    thr_B1 = jnp.take_along_axis(sorted_BV, (n_keep_B - 1)[:, None], axis=-1)
    return jnp.where(scaled_BV >= thr_B1, scaled_BV, -jnp.inf)


def select_tokens(logits_BV, keys_B, temperature_B, top_k_B, top_p_B, use_filter: bool = True):
    """Returns (tokens int32 [B], behaviour logprob f32 [B], raw logprob f32 [B]).

    temperature <= 0 means greedy (argmax of the raw logits). use_filter is static: pass
    False when no row uses top-k/top-p to skip the vocabulary sort. When every row is greedy
    the sampling work (filter, Gumbel noise, behaviour log-softmax) is skipped (lax.cond)."""
    logits_BV = logits_BV.astype(jnp.float32)
    raw_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    greedy_B = temperature_B <= 0
    argmax_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    pick = lambda a, t: jnp.take_along_axis(a, t[:, None], axis=-1)[:, 0]  # noqa: E731

    def draw():
        t_B = jnp.where(greedy_B, 1.0, temperature_B).astype(jnp.float32)
        scaled_BV = logits_BV / t_B[:, None]
        if use_filter:
            scaled_BV = filter_logits(scaled_BV, top_k_B, top_p_B)
        sampled_B = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys_B, scaled_BV)
        tok_B = jnp.where(greedy_B, argmax_B, sampled_B).astype(jnp.int32)
        return tok_B, jnp.where(greedy_B, 0.0, pick(jax.nn.log_softmax(scaled_BV, axis=-1), tok_B))

    tok_B, lp_B = jax.lax.cond(jnp.all(greedy_B), lambda: (argmax_B, jnp.zeros(argmax_B.shape, jnp.float32)), draw)
    return tok_B, lp_B, pick(raw_BV, tok_B)


def row_keys(seed_B, request_id_B, sample_B):
    """Per-row base keys: fold_in(fold_in(key(seed), request_id), sample_index)."""
    def one(s, r, i):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r), i)
    return jax.vmap(one)(seed_B, request_id_B, sample_B)


def step_keys(base_key_B, step_B):
    """The key of a row's step-th generated token."""
    return jax.vmap(jax.random.fold_in)(base_key_B, step_B)
