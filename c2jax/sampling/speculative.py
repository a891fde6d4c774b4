"""MTP speculative decoding: the Sampler's prefill and decode kernels when speculative="mtp".

Each decode step (per row, on device inside the chunk's while_loop):
  verify  one main-model forward over the window [cur, x_1..x_d] at positions pos..pos+d on the
          KV cache (x = the d tokens drafted by the MTP heads in the previous step);
  accept  greedy rows: the longest prefix of drafts equal to the main model's argmax; sampling
          rows: speculative sampling (accept x_j with prob min(1, p/q), on rejection sample
          the residual max(0, p - q), after d acceptances a bonus token from p), so every
          emitted token is distributed exactly as in plain decoding; p and q are the main
          model's and the MTP head's distributions after the row's temperature / top-k / top-p;
  emit    the accepted drafts and the correction token (cut at a stop id / max tokens / cache
          end), with the main model's behaviour and raw logprobs and its expert ids for each
          consumed position; the cache position advances by the tokens consumed, so rejected
          drafts' KV entries sit past `pos` (never visible, overwritten later): the roll-back;
  draft   MTP head k (k = 1..d) runs over the window on its own KV cache with the main hidden
          states (k = 1) or head k-1's (k > 1) and the tokens k ahead, and drafts x'_k at the
          last accepted position from the head's logits (argmax, or a sample from q).
Prefill also runs the MTP heads over the prompt (filling their caches) and drafts the first d.

MTP caches: head 1's entries are exactly the training MTP forward's (true tokens); a head k > 1
entry whose k-ahead token was still a draft when it was written is not recomputed (that only
lowers acceptance, never changes outputs); with prefix reuse the entry just before the reused
prefix's end is likewise stale.

Letters: B slots, S cache slots, W = d + 1 window, d MTP depth, V vocab, N MoE layers, K top-k,
R rows of a draft call, C decode steps per chunk, E = C * W buffer entries.
"""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_collections

from c2jax.models import transformer as tfm
from c2jax.sampling import logits as lg
from c2jax.sampling.rows import finish_codes, prefill_rows


def behaviour_logprobs(logits_BV, temp_B, top_k_B, top_p_B, use_filter: bool):
    """log of the distribution a row samples from (lg.select_tokens' behaviour distribution)."""
    greedy_B = temp_B <= 0
    t_B = jnp.where(greedy_B, 1.0, temp_B).astype(jnp.float32)
    scaled_BV = logits_BV.astype(jnp.float32) / t_B[:, None]
    if use_filter:
        scaled_BV = lg.filter_logits(scaled_BV, top_k_B, top_p_B)
    return jax.nn.log_softmax(scaled_BV, axis=-1)


def verify(logits_BWV, drafts_Bd, logq_BdV, keys_B, temp_B, top_k_B, top_p_B, use_filter: bool = True):
    """Accept drafts against the main model's window logits.

    Returns (tokens int32 [B, W], n_acc int32 [B], behaviour lp [B, W], raw lp [B, W]): tokens
    j < n_acc are the accepted drafts, token n_acc the correction (or bonus) token; entries
    past n_acc are 0."""
    B, W, V = logits_BWV.shape
    d = W - 1
    rep = lambda a: jnp.repeat(a, W, axis=0)
    logp_BWV = behaviour_logprobs(logits_BWV.reshape(B * W, V), rep(temp_B), rep(top_k_B), rep(top_p_B),
                                  use_filter).reshape(B, W, V)
    raw_BWV = jax.nn.log_softmax(logits_BWV.astype(jnp.float32), axis=-1)
    greedy_B = temp_B <= 0
    best_BW = jnp.argmax(logits_BWV, axis=-1).astype(jnp.int32)
    k_u, k_r = (jax.vmap(lambda k, i=i: jax.random.fold_in(k, i))(keys_B) for i in (2, 3))
    u_Bd = jax.vmap(lambda k: jax.random.uniform(k, (d,), minval=1e-38))(k_u) if d else jnp.zeros((B, 0))
    at = lambda a, t: jnp.take_along_axis(a, t[..., None], axis=-1)[..., 0]
    log_ratio_Bd = at(logp_BWV[:, :d], drafts_Bd) - at(logq_BdV, drafts_Bd)
    acc_Bd = jnp.where(greedy_B[:, None], drafts_Bd == best_BW[:, :d], jnp.log(u_Bd) < log_ratio_Bd)
    n_acc_B = jnp.sum(jnp.cumprod(acc_Bd.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(B)
    logq_pad = jnp.concatenate([logq_BdV, jnp.full((B, 1, V), -jnp.inf, jnp.float32)], axis=1)
    p_BV, q_BV = jnp.exp(logp_BWV[rows, n_acc_B]), jnp.exp(logq_pad[rows, n_acc_B])
    resid_BV = jnp.maximum(p_BV - q_BV, 0.0)
    resid_log_BV = jnp.where(jnp.sum(resid_BV, -1, keepdims=True) > 0, jnp.log(resid_BV),
                             logp_BWV[rows, n_acc_B])
    sampled_B = jax.vmap(jax.random.categorical)(k_r, resid_log_BV)
    corr_B = jnp.where(greedy_B, best_BW[rows, n_acc_B], sampled_B).astype(jnp.int32)
    jW = jnp.arange(W)[None]
    drafts_pad = jnp.concatenate([drafts_Bd, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tok_BW = jnp.where(jW < n_acc_B[:, None], drafts_pad, jnp.where(jW == n_acc_B[:, None], corr_B[:, None], 0))
    lp_BW = jnp.where(greedy_B[:, None], 0.0, at(logp_BWV, tok_BW))
    return tok_BW, n_acc_B, lp_BW, at(raw_BWV, tok_BW)


def draft(m, params, h_RWD, z_RW, start_R, last_R, valid_R, mtp_cache, keys_R, temp_R, top_k_R, top_p_R,
          use_filter, S):
    """Run MTP heads 1..d over window positions start..start+last (z[:, j] = token at position
    start+j+1, true for j <= last) and draft d tokens after z[:, last].
    Returns (drafts int32 [R, d], draft log-probs [R, d, V], new mtp caches)."""
    d = m.num_mtp_layers
    R, Wn = z_RW.shape
    jW = jnp.arange(Wn)[None]
    positions = jnp.where((jW <= last_R[:, None]) & valid_R[:, None], start_R[:, None] + jW, S)
    greedy_R = temp_R <= 0
    drafts = jnp.zeros((R, d), jnp.int32)
    logqs, caches, h = [], [], h_RWD
    for k in range(1, d + 1):
        idx = jW + (k - 1)                                   # window index of the token k ahead
        from_z = idx <= last_R[:, None]
        z_tok = jnp.take_along_axis(z_RW, jnp.minimum(idx, Wn - 1).repeat(R, 0), axis=1)
        d_tok = jnp.take_along_axis(drafts, jnp.clip(idx - last_R[:, None] - 1, 0, d - 1), axis=1)
        logits, h, c = tfm.mtp_forward_with_cache(m, params, k, h, jnp.where(from_z, z_tok, d_tok), positions,
                                                  mtp_cache[k - 1])
        caches.append(c)
        last_RV = logits[jnp.arange(R), last_R]
        logq = behaviour_logprobs(last_RV, temp_R, top_k_R, top_p_R, use_filter)
        kk = jax.vmap(lambda key, k=k: jax.random.fold_in(key, 10 + k))(keys_R)
        x = jnp.where(greedy_R, jnp.argmax(last_RV, -1), jax.vmap(jax.random.categorical)(kk, logq))
        drafts = drafts.at[:, k - 1].set(x.astype(jnp.int32))
        logqs.append(logq)
    return drafts, jnp.stack(logqs, axis=1), caches


def init_cache(m, B: int, S: int, dtype=None) -> dict:
    """Main KV cache + MTP head caches + the pending drafts and their log-probs per slot."""
    d = m.num_mtp_layers
    cache = {"model": tfm.init_cache(m, B, S, dtype), "mtp": tfm.init_mtp_cache(m, B, S, dtype),
             "draft": jnp.zeros((B, d), jnp.int32), "logq": jnp.zeros((B, d, m.vocab_size), jnp.float32)}
    return jax.tree.map(lambda a: jnp.array(a), cache)


@functools.lru_cache(maxsize=16)
def kernels(model_json: str, S: int, B: int):
    """(prefill, decode, N): drop-in replacements of engine._kernels' for speculative="mtp"."""
    m = ml_collections.ConfigDict(json.loads(model_json))
    d = m.num_mtp_layers
    if d < 1:
        raise ValueError("speculative='mtp' needs a model with MTP heads (model.num_mtp_layers >= 1)")
    W = d + 1
    _, N = tfm.layer_counts(m)

    @functools.partial(jax.jit, donate_argnums=(1, 2), static_argnames=("use_filter",))
    def prefill(params, cache, state, tokens_bL, start_b, len_b, src_slot_b,
                dest_slot_M, dest_src_M, seed_M, rid_M, sidx_M, max_new_M, temp_M, top_k_M, top_p_M, stop_MX,
                use_filter=True):
        b = tokens_bL.shape[0]
        step = lambda t, p, c: tfm.forward_with_cache_hidden(m, params, t, p, c)  # noqa: E731
        main, state, outs, (_, hidden_bLD), key0 = prefill_rows(
            step, N, S, cache["model"], state, tokens_bL, start_b, len_b, src_slot_b, dest_slot_M, dest_src_M,
            seed_M, rid_M, sidx_M, max_new_M, temp_M, top_k_M, top_p_M, stop_MX, use_filter)
        tok = outs[0]
        one = jnp.ones_like(tok)
        # MTP heads over the prompt suffix of every destination row (its own first token last)
        len_M = len_b[dest_src_M]
        z = jnp.concatenate([tokens_bL[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)[dest_src_M]
        z = z.at[jnp.arange(z.shape[0]), len_M - 1].set(tok)
        sub_mtp = jax.tree.map(lambda c: c[src_slot_b[dest_src_M]], cache["mtp"])
        drafts, logq, mtp = draft(m, params, hidden_bLD[dest_src_M], z, start_b[dest_src_M], len_M - 1,
                                  dest_slot_M < B, sub_mtp, jax.vmap(jax.random.fold_in)(key0, one),
                                  temp_M, top_k_M, top_p_M, use_filter, S)
        put = lambda c, s: c.at[dest_slot_M].set(s, mode="drop")
        cache = {"model": main, "mtp": jax.tree.map(put, cache["mtp"], mtp),
                 "draft": put(cache["draft"], drafts), "logq": put(cache["logq"], logq)}
        return cache, state, outs

    @functools.partial(jax.jit, donate_argnums=(1, 2), static_argnames=("C", "use_filter"))
    def decode(weights, cache, state, min_live, C=32, use_filter=True):
        """Up to C speculative steps (each consumes up to W positions per row) on the Sampler's
        DecodeWeights (the model weights: speculation runs the scanned model). Buffers hold
        per row its consumed positions in order (E = C * W entries); returns the largest count
        as the step count the host slices by, and "spec" = [steps, drafted, accepted]."""
        params = weights.model
        K = m.num_experts_per_tok
        E = C * W
        bufs = {"tok": jnp.full((E, B), -1, jnp.int32), "lp": jnp.zeros((E, B), jnp.float32),
                "raw": jnp.zeros((E, B), jnp.float32), "gen": jnp.zeros((E, B), bool),
                "used": jnp.zeros((E, B), bool), "code": jnp.zeros((E, B), jnp.int32)}
        if N:
            bufs["experts"] = jnp.zeros((E, N, B, K), jnp.int32)
        jW = jnp.arange(W, dtype=jnp.int32)[None]
        rows = jnp.arange(B)

        def cond(carry):
            i, _, st, _, _, _ = carry
            n_live = jnp.sum(st.live)
            return (i < C) & (n_live > 0) & (n_live >= min_live)

        def body(carry):
            i, cache, st, bufs, cnt, stats = carry
            gen = st.live & ~st.done
            window = jnp.concatenate([st.cur[:, None], cache["draft"]], axis=1)
            positions = jnp.where(st.live[:, None], st.pos[:, None] + jW, S)
            out, hidden = tfm.forward_with_cache_hidden(m, params, window, positions, cache["model"])
            key = lg.step_keys(st.key, st.ngen)
            tok, n_acc, lp, raw = verify(out.logits, cache["draft"], cache["logq"], key, st.temp, st.top_k,
                                         st.top_p, use_filter)
            flat = lambda a: a.reshape(-1)
            code = finish_codes(flat(tok), flat(st.ngen[:, None] + jW + 1), flat(st.pos[:, None] + jW + 1),
                                 jnp.repeat(st.max_new, W), jnp.repeat(st.stop, W, axis=0), S).reshape(B, W)
            code = jnp.where(jW <= n_acc[:, None], code, 0)
            first_stop = jnp.where(jnp.any(code > 0, 1), jnp.argmax(code > 0, 1), W)
            n_emit = jnp.where(gen, jnp.minimum(n_acc, first_stop) + 1, 0)
            n_used = jnp.where(gen, n_emit, st.live.astype(jnp.int32))
            last = jnp.maximum(n_emit - 1, 0)
            code_last = jnp.where(gen, code[rows, last], 0)
            new = st._replace(
                cur=jnp.where(gen, tok[rows, last], st.cur), pos=st.pos + n_used, live=st.live & ~st.done,
                done=st.done | (code_last > 0), ngen=st.ngen + n_emit,
                reason=jnp.where(code_last > 0, code_last, st.reason))
            emit = jW < n_emit[:, None]
            row = {"tok": jnp.where(emit, tok, -1), "lp": lp, "raw": raw, "gen": emit,
                   "used": jW < n_used[:, None], "code": jnp.where(emit, code, 0)}
            idx_WB = jnp.where(jW < n_used[:, None], cnt[:, None] + jW, E).T
            col_WB = jnp.broadcast_to(rows[None], idx_WB.shape)
            bufs = {k: bufs[k].at[idx_WB, col_WB].set(row[k].T, mode="drop") for k in row} | (
                {"experts": bufs["experts"].at[idx_WB, :, col_WB].set(
                    jnp.transpose(out.aux["expert_ids"], (2, 1, 0, 3)), mode="drop")} if N else {})
            # drafts for the next step from the last emitted token (rows that keep generating)
            cont = gen & (code_last == 0)
            drafts, logq, mtp = draft(m, params, hidden, tok, st.pos, last, cont, cache["mtp"],
                                      jax.vmap(jax.random.fold_in)(key, jnp.ones_like(st.ngen)), st.temp,
                                      st.top_k, st.top_p, use_filter, S)
            keep = lambda a, b: jnp.where(cont.reshape((B,) + (1,) * (a.ndim - 1)), a, b)
            cache = {"model": out.cache, "mtp": mtp, "draft": keep(drafts, cache["draft"]),
                     "logq": keep(logq, cache["logq"])}
            stats = stats + jnp.stack([jnp.int32(1), d * jnp.sum(gen), jnp.sum(jnp.where(gen, n_acc, 0))])
            return i + 1, cache, new, bufs, cnt + n_used, stats

        carry = (jnp.int32(0), cache, state, bufs, jnp.zeros((B,), jnp.int32), jnp.zeros((3,), jnp.int32))
        _, cache, state, bufs, cnt, stats = jax.lax.while_loop(cond, body, carry)
        return cache, state, jnp.max(cnt), {**bufs, "spec": stats}

    return prefill, decode, N


def bigram_mtp_params(cfg, params, alpha: float = 0.3, seed: int = 0):
    """A constructed model whose MTP heads predict well (tests and the bench): embeddings and
    output head encode next = (7 t + 3) % V, each MTP head's eh_proj passes only the ahead
    token's embedding (so head k predicts the token after it), and every attention / MLP / expert
    output projection is scaled by alpha (the perturbation the drafts can disagree with)."""
    import numpy as np

    m = tfm.model_cfg(cfg)
    V, D = m.vocab_size, m.hidden_size
    if m.tie_embeddings:
        raise ValueError("bigram_mtp_params needs model.tie_embeddings=False")
    e = np.random.default_rng(seed).standard_normal((V, D)).astype(np.float32)
    e *= np.sqrt(D) / np.linalg.norm(e, axis=1, keepdims=True)
    head = np.zeros((D, V), np.float32)
    head[:, (7 * np.arange(V) + 3) % V] = e.T * (8.0 / D)
    out_proj = ("o_proj", "down")

    def scale(path, x):
        names = [getattr(k, "key", None) for k in path]
        return x * alpha if names[-1] == "w_down" or (names[-1] == "kernel" and names[-2] in out_proj) else x
    p = jax.tree_util.tree_map_with_path(scale, params)
    p["embed"], p["lm_head"] = jnp.asarray(e), {"kernel": jnp.asarray(head)}
    for k in range(1, m.num_mtp_layers + 1):
        p[f"mtp_{k}"]["eh_proj"] = {"kernel": jnp.eye(2 * D, D, dtype=jnp.float32)}
    return p
