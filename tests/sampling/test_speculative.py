"""MTP speculative decoding: the acceptance rule keeps the output distribution; greedy
speculative output equals plain greedy token for token (tokens, logprobs, expert ids, finish
reasons) with random MTP heads (drafts mostly rejected) and with constructed heads that predict
well (multi-token acceptance); sampled tokens' logprobs and expert ids match the trainer."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.models import transformer as tfm
from c2jax.sampling import Sampler, generate
from c2jax.sampling.speculative import bigram_mtp_params, verify

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
KW = {"max_batch": 3, "max_len": 40, "chunk": 4}
PAD = 48


def make_cfg(attention="gqa", depth=2):
    cfg = c2jax.config.default_config()
    cfg.model.attention = attention
    cfg.model.moe_dispatch = "dropless"
    cfg.model.init_std = 0.2
    cfg.model.num_mtp_layers = depth
    return cfg


@functools.cache
def setup(attention="gqa", constructed=False):
    cfg = make_cfg(attention)
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    return cfg, (bigram_mtp_params(cfg, params) if constructed else params)


def run_pair(cfg, params, **kw):
    plain = generate(cfg, params, PROMPTS, **KW, **kw)
    spec = generate(cfg, params, PROMPTS, speculative="mtp", **KW, **kw)
    return plain, spec


def assert_same(plain, spec):
    assert spec.tokens == plain.tokens
    assert spec.finish_reason == plain.finish_reason
    for i in range(len(PROMPTS)):
        for a, b in zip(plain.completions[i], spec.completions[i]):
            np.testing.assert_allclose(b.raw_logprobs, a.raw_logprobs, atol=1e-5)
            np.testing.assert_array_equal(b.logprobs, a.logprobs)
            np.testing.assert_array_equal(b.expert_ids, a.expert_ids)
            np.testing.assert_array_equal(b.versions, a.versions)


def test_mtp_cache_path_matches_training_mtp_logits():
    cfg, params = setup("gqa")
    m, L = cfg.model, 12
    toks = jax.random.randint(jax.random.key(5), (2, L), 0, m.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(L), (2, L))
    ref = c2jax.models.forward(cfg, params, toks, return_aux=True).aux["mtp_logits"]
    out, h = tfm.forward_with_cache_hidden(cfg, params, toks, pos, tfm.init_cache(cfg, 2, 16))
    for k, cache in enumerate(tfm.init_mtp_cache(cfg, 2, 16), start=1):
        ahead = jnp.concatenate([toks[:, k:], jnp.zeros((2, k), jnp.int32)], axis=1)
        logits, h, _ = tfm.mtp_forward_with_cache(cfg, params, k, h, ahead, pos, cache)
        # the training forward's depth-k logits at t + k are the prediction made at t
        np.testing.assert_allclose(logits[:, :L - k], ref[k - 1, :, k:], atol=1e-4)


def test_acceptance_rule_keeps_distribution():
    V, d, n = 5, 2, 40000
    k = jax.random.split(jax.random.key(0), 4)
    logits_WV = jax.random.normal(k[0], (d + 1, V)) * 1.5
    logq_dV = jax.nn.log_softmax(jax.random.normal(k[1], (d, V)) * 1.5, -1)
    drafts = jnp.stack([jax.random.categorical(kk, logq_dV[j], shape=(n,))
                        for j, kk in enumerate(jax.random.split(k[2], d))], 1).astype(jnp.int32)
    keys = jax.random.split(k[3], n)
    ones = jnp.ones((n,))
    tok, n_acc, lp, raw = verify(jnp.broadcast_to(logits_WV, (n, d + 1, V)), drafts,
                                 jnp.broadcast_to(logq_dV, (n, d, V)), keys, ones, jnp.zeros((n,), jnp.int32),
                                 ones, use_filter=False)
    p0 = np.asarray(jax.nn.softmax(logits_WV[0]))
    freq = np.bincount(np.asarray(tok[:, 0]), minlength=V) / n
    np.testing.assert_allclose(freq, p0, atol=0.012)           # ~4 sigma at n = 40000
    assert 0 < float(jnp.mean(n_acc)) < d
    np.testing.assert_allclose(raw[:, 0], jax.nn.log_softmax(logits_WV[0])[tok[:, 0]], rtol=1e-6)
    # greedy rows: accept exactly the drafts equal to the argmax
    best = jnp.argmax(logits_WV, -1)
    g_drafts = jnp.array([[best[0], best[1]], [best[0], (best[1] + 1) % V], [(best[0] + 1) % V, best[1]]], jnp.int32)
    g_tok, g_acc, g_lp, _ = verify(jnp.broadcast_to(logits_WV, (3, d + 1, V)), g_drafts,
                                   jnp.broadcast_to(logq_dV, (3, d, V)), keys[:3], jnp.zeros((3,)),
                                   jnp.zeros((3,), jnp.int32), jnp.ones((3,)), use_filter=False)
    assert g_acc.tolist() == [2, 1, 0]
    assert g_tok[0].tolist() == best.tolist() and g_tok[1, :2].tolist() == best[:2].tolist()
    assert g_tok[2, 0] == best[0] and not np.any(g_lp)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_greedy_equals_plain_with_random_heads(attention):
    cfg, params = setup(attention)
    plain, spec = run_pair(cfg, params, max_new_tokens=8, temperature=0.0)
    assert_same(plain, spec)
    rate = spec.stats["spec_accepted"] / spec.stats["spec_drafted"]
    print(f"random MTP heads ({attention}): acceptance {rate:.2f}")


def test_greedy_equals_plain_with_predicting_heads_and_stops():
    cfg, params = setup("gqa", constructed=True)
    plain, spec = run_pair(cfg, params, max_new_tokens=16, temperature=0.0)
    assert_same(plain, spec)
    st = spec.stats
    print(f"constructed MTP heads: acceptance {st['spec_accepted'] / st['spec_drafted']:.2f}, "
          f"decode steps {st['decode_steps']} vs {plain.stats['decode_steps']} plain")
    assert st["spec_accepted"] >= 0.9 * st["spec_drafted"]
    assert st["decode_steps"] * 2 < plain.stats["decode_steps"]
    # a stop id inside an accepted window: the row stops there, like plain decoding
    stop = plain.tokens[0][0][4]
    plain_s, spec_s = run_pair(cfg, params, max_new_tokens=16, temperature=0.0, stop_token_ids=[stop])
    assert spec_s.finish_reason[0][0] == "stop" and spec_s.tokens[0][0][-1] == stop
    assert_same(plain_s, spec_s)


def test_sampled_logprobs_and_experts_match_trainer():
    cfg, params = setup("gqa", constructed=True)
    out = generate(cfg, params, PROMPTS, max_new_tokens=10, temperature=1.0, n=2, seed=3, speculative="mtp",
                   **KW)
    assert 0 < out.stats["spec_accepted"] < out.stats["spec_drafted"]
    fwd = jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t, return_aux=True))
    for i, p in enumerate(PROMPTS):
        for j in range(2):
            seq = p + out.tokens[i][j]
            toks = np.zeros((1, PAD), np.int32)
            toks[0, :len(seq)] = seq
            ref = fwd(params, toks)
            lp = np.asarray(jax.nn.log_softmax(ref.logits[0, :len(seq)], -1))
            want = lp[np.arange(len(p) - 1, len(seq) - 1), out.tokens[i][j]]
            np.testing.assert_allclose(out.raw_logprobs[i][j], want, atol=1e-4)
            np.testing.assert_allclose(out.logprobs[i][j], want, atol=1e-4)  # T = 1, no filter
            np.testing.assert_array_equal(out.expert_ids[i][j],
                                          np.asarray(ref.aux["expert_ids"][:, 0, :len(seq)]).transpose(1, 0, 2))
    again = generate(cfg, params, PROMPTS, max_new_tokens=10, temperature=1.0, n=2, seed=3, speculative="mtp", **KW)
    assert again.tokens == out.tokens


def test_bad_options():
    cfg, params = setup("gqa")
    with pytest.raises(ValueError, match="speculative"):
        Sampler(cfg, params, speculative="eagle", **KW)
    plain_cfg = make_cfg(depth=0)
    with pytest.raises(ValueError, match="num_mtp_layers"):
        Sampler(plain_cfg, c2jax.models.init_params(plain_cfg, jax.random.key(0)), speculative="mtp", **KW)


def test_speculative_sampler_distribution_equals_the_model_at_temperature_1():
    """End to end through the Sampler: two sampled tokens after a prompt, drafted by two random
    MTP heads (some drafts accepted, some rejected), against the model's exact joint
    distribution over all V^2 continuations (chi-square); the plain sampler the same way."""
    from scipy import stats
    cfg = make_cfg(depth=2)
    cfg.model.vocab_size, cfg.model.init_std = 8, 0.6
    params = c2jax.models.init_params(cfg, jax.random.key(7))
    V, prompt, n = 8, [1, 5, 2], 2400
    seqs = jnp.asarray([[*prompt, a, b] for a in range(V) for b in range(V)], jnp.int32)
    lp = jax.nn.log_softmax(c2jax.models.forward(cfg, params, seqs), -1)
    p_exact = np.exp(np.asarray(lp[:, 2, :][jnp.arange(V * V), seqs[:, 3]] + lp[:, 3, :][jnp.arange(V * V), seqs[:, 4]]))
    assert abs(p_exact.sum() - 1) < 1e-4
    p_exact = p_exact.astype(np.float64) / p_exact.sum(dtype=np.float64)
    for mode in ("mtp", "none"):
        out = generate(cfg, params, [prompt], max_new_tokens=2, n=n, temperature=1.0, seed=11, speculative=mode,
                       max_batch=16, max_len=8, chunk=4)
        if mode == "mtp":
            acc = out.stats["spec_accepted"] / out.stats["spec_drafted"]
            assert 0.05 < acc < 0.95, acc       # both the accept and the reject/residual paths ran
        counts = np.bincount([a * V + b for a, b in out.tokens[0]], minlength=V * V)
        keep = p_exact * n >= 5                    # pool the cells expected below 5 (chi-square validity)
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(p_exact[keep], p_exact[~keep].sum()) * n
        p_value = stats.chisquare(obs, exp).pvalue
        assert p_value > 1e-3, (mode, p_value)
