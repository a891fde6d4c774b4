"""Consistency of the jitted sampler with the training forward (greedy tokens, logprobs,
expert ids), determinism, batch invariance, stops, continuous batching, multi-turn
continuation and in-flight weight swaps. Tiny models, a few tokens each."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.sampling import (
    HarnessSampler,
    Request,
    Sampler,
    filter_logits,
    generate,
    select_tokens,
)

PAD = 48  # reference forward runs on sequences padded to this length (causal: padding is harmless)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
# One sampler shape everywhere (compiles dominate the runtime). 3 slots x top-2 < 8 experts, so
# decode steps use the gather MoE dispatch and prefills the model's own dispatch: both covered.
KW = {"max_batch": 3, "max_len": 32, "chunk": 4}


def make_cfg(attention="gqa", dtype="float32"):
    cfg = c2jax.config.default_config()
    cfg.model.attention = attention
    cfg.model.moe_dispatch = "dropless"  # dropless reference routing
    cfg.model.init_std = 0.2            # peaked logits: greedy argmax is not decided by float noise
    cfg.model.dtype = dtype
    return cfg


@functools.cache
def setup(attention="gqa"):
    cfg = make_cfg(attention)
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    return cfg, params


@functools.cache
def ref_forward(attention="gqa", dtype="float32"):
    cfg = make_cfg(attention, dtype)
    return jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t, return_aux=True))


def reference(attention, params, seq, dtype="float32"):
    """(log_softmax [len, V], expert ids [len, N, K]) of the training forward on seq."""
    toks = np.zeros((1, PAD), np.int32)
    toks[0, :len(seq)] = seq
    out = ref_forward(attention, dtype)(params, toks)
    lp = np.asarray(jax.nn.log_softmax(out.logits[0, :len(seq)], -1))
    ex = np.asarray(out.aux["expert_ids"][:, 0, :len(seq)]).transpose(1, 0, 2)
    return lp, ex


def test_greedy_equals_stepwise_argmax():
    attention = "gqa"  # MLA: covered by the logprob and multi-turn tests below
    cfg, params = setup(attention)
    out = generate(cfg, params, PROMPTS, max_new_tokens=6, temperature=0.0, n=1, **KW)
    for p, toks, reasons in zip(PROMPTS, out.tokens, out.finish_reason):
        seq = list(p)
        for _ in range(6):
            lp, _ = reference(attention, params, seq)
            seq.append(int(np.argmax(lp[-1])))
        assert toks[0] == seq[len(p):]
        assert reasons[0] == "length"


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_logprobs_and_expert_ids_match_trainer(attention):
    cfg, params = setup(attention)
    out = generate(cfg, params, PROMPTS, max_new_tokens=8, temperature=1.0, n=2, seed=3, **KW)  # 6 rows, 3 slots
    for i, p in enumerate(PROMPTS):
        for j in range(2):
            seq = p + out.tokens[i][j]
            lp, ex = reference(attention, params, seq)
            ref = lp[np.arange(len(p) - 1, len(seq) - 1), out.tokens[i][j]]
            np.testing.assert_allclose(out.logprobs[i][j], ref, atol=1e-4)   # temperature 1: behaviour == raw
            np.testing.assert_allclose(out.raw_logprobs[i][j], ref, atol=1e-4)
            assert out.expert_ids[i][j].shape == (len(seq), 2, 2)
            np.testing.assert_array_equal(out.expert_ids[i][j], ex)
            assert (out.versions[i][j] == 0).all()
    # the group shares one prefill per prompt
    assert out.stats["prefill_tokens"] == sum(len(p) for p in PROMPTS)


def test_bf16_logprob_gap():
    """bf16 compute: the sampler's logprobs vs the bf16 trainer forward (reported, loosely bounded)."""
    cfg = make_cfg("gqa", "bfloat16")
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    out = generate(cfg, params, PROMPTS[2:], max_new_tokens=8, temperature=1.0, n=1, **KW)
    seq = PROMPTS[2] + out.tokens[0][0]
    idx = (np.arange(len(PROMPTS[2]) - 1, len(seq) - 1), out.tokens[0][0])
    gap_bf16 = np.abs(out.raw_logprobs[0][0] - reference("gqa", params, seq, "bfloat16")[0][idx]).max()
    gap_f32 = np.abs(out.raw_logprobs[0][0] - reference("gqa", params, seq)[0][idx]).max()
    print(f"bf16 sampler: max |logprob gap| vs bf16 trainer {gap_bf16:.4f}, vs f32 trainer {gap_f32:.4f}")
    assert gap_bf16 < 0.25 and gap_f32 < 0.25


def test_same_seed_same_outputs_and_batch_invariance():
    cfg, params = setup("gqa")
    kw = {"max_new_tokens": 6, "temperature": 1.0, "seed": 7, "top_k": 50, "top_p": 0.9}
    s = Sampler(cfg, params, **KW)
    rids = [s.submit(Request(p, request_id=100 + i, n=1, **kw)) for i, p in enumerate(PROMPTS)]
    s.run_until_done()
    together = [s.results(r)[0] for r in rids]
    # the same requests one at a time, in another order, in other slots
    s2 = Sampler(cfg, params, **KW)
    for i in (2, 0, 1):
        r = s2.submit(Request(PROMPTS[i], request_id=100 + i, n=1, **kw))
        s2.run_until_done()
        alone = s2.results(r)[0]
        assert alone.tokens == together[i].tokens
        np.testing.assert_allclose(alone.logprobs, together[i].logprobs, atol=1e-5)
    # different seed, different tokens
    s3 = s2
    r = s3.submit(Request(PROMPTS[2], request_id=102, n=1, **dict(kw, seed=8)))
    s3.run_until_done()
    assert s3.results(r)[0].tokens != together[2].tokens


def test_top_k_top_p_filter():
    select = jax.jit(select_tokens)
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    f = jax.jit(filter_logits)(logits, jnp.array([2, 0]), jnp.array([1.0, 0.85]))
    assert np.isfinite(np.asarray(f)).tolist() == [[True, True, False, False], [True, True, True, False]]
    keys = jax.random.split(jax.random.key(0), 2)
    tok, lp, raw = select(logits, keys, jnp.array([1.0, 1.0]), jnp.array([2, 0]), jnp.array([1.0, 0.85]))
    p = np.array([[0.5, 0.3] + [0] * 2, [0.5, 0.3, 0.15, 0]])
    p = p / p.sum(1, keepdims=True)
    np.testing.assert_allclose(np.exp(lp), p[[0, 1], np.asarray(tok)], rtol=1e-5)
    np.testing.assert_allclose(np.exp(raw), np.array([0.5, 0.3, 0.15, 0.05])[np.asarray(tok)], rtol=1e-5)
    # greedy: argmax, behaviour logprob 0
    tok, lp, _ = select(logits, keys, jnp.array([0.0, 0.0]), jnp.array([0, 0]), jnp.array([1.0, 1.0]))
    assert np.asarray(tok).tolist() == [0, 0] and np.asarray(lp).tolist() == [0.0, 0.0]
    # many draws at top_k=2 never leave the top-2 set
    keys = jax.random.split(jax.random.key(1), 256)
    lg = jnp.broadcast_to(logits[0], (256, 4))
    tok, _, _ = select(lg, keys, jnp.full((256,), 2.0), jnp.full((256,), 2), jnp.ones((256,)))
    assert set(np.asarray(tok).tolist()) == {0, 1}


def test_stop_tokens_stop_strings_and_max_len():
    cfg, params = setup("gqa")
    greedy = generate(cfg, params, PROMPTS[:1], max_new_tokens=6, temperature=0.0, **KW)
    toks = greedy.tokens[0][0]
    out = generate(cfg, params, PROMPTS[:1], max_new_tokens=6, temperature=0.0, stop_token_ids=[toks[2]],
                   **KW)
    k = toks.index(toks[2])
    assert out.tokens[0][0] == toks[:k + 1] and out.finish_reason[0][0] == "stop"
    assert out.expert_ids[0][0].shape[0] == len(PROMPTS[0]) + k + 1
    detok = lambda ids: "".join(f"<{i}>" for i in ids)
    out = generate(cfg, params, PROMPTS[:1], max_new_tokens=6, temperature=0.0, stop_strings=[f"<{toks[3]}>"],
                   detokenize=detok, **KW)
    k = toks.index(toks[3])
    assert out.tokens[0][0] == toks[:k + 1] and out.finish_reason[0][0] == "stop_string"
    assert out.expert_ids[0][0].shape[0] == len(PROMPTS[0]) + k + 1
    # cache end: a 29-token prompt leaves 3 positions of the 32
    s = Sampler(cfg, params, **KW)
    prompt = list(range(100, 124)) + PROMPTS[0]
    r = s.submit(Request(prompt, max_new_tokens=50, temperature=0.0))
    s.run_until_done()
    c = s.results(r)[0]
    assert c.finish_reason == "max_len" and len(prompt) + len(c.tokens) == 32
    assert len(c.tokens) == 3 and c.expert_ids.shape[0] == 32


def test_continuous_batching_refills_slots():
    cfg, params = setup("gqa")
    lens = [2, 9, 3, 1, 5, 2]
    s = Sampler(cfg, params, **KW)
    rids = [s.submit(Request(PROMPTS[i % 3], max_new_tokens=n, temperature=1.0, request_id=i, seed=1))
            for i, n in enumerate(lens)]
    s.run_until_done()
    outs = [s.results(r)[0] for r in rids]
    assert [len(o.tokens) for o in outs] == lens
    # rows refilled as soon as one finished: fewer device steps than in two waves of 3
    # (each row takes max_new_tokens steps: n - 1 decode + 1 flush)
    assert s.decode_steps < max(lens[:3]) + max(lens[3:])
    # the same tokens as each request alone
    for i, n in enumerate(lens):
        r = s.submit(Request(PROMPTS[i % 3], max_new_tokens=n, temperature=1.0, request_id=i, seed=1))
        s.run_until_done()
        assert s.results(r)[0].tokens == outs[i].tokens


def test_weight_swap_mid_generation():
    cfg, params = setup("gqa")
    new_params = c2jax.models.init_params(cfg, jax.random.key(1))
    kw = {"max_new_tokens": 12, "temperature": 0.0}

    def run(swap):
        s = Sampler(cfg, params, version=3, **KW)
        r = s.submit(Request(PROMPTS[2], **kw))
        s.step_chunk()  # prefill (1 token) + 4 decode steps
        if swap:
            s.swap_params(new_params, 4)
        s.run_until_done()
        return s.results(r)[0]

    before, after = run(False), run(True)
    assert after.tokens[:5] == before.tokens[:5]
    assert after.versions.tolist() == [3] * 5 + [4] * 7
    assert after.tokens[5:] != before.tokens[5:]
    # the swap kept the cache: the first post-swap step reads keys written by the old weights,
    # so it differs from a fresh new-weight run on the same prefix only through those keys
    assert after.expert_ids.shape[0] == len(PROMPTS[2]) + 12


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_harness_adapter_continues_slot(attention):
    cfg, params = setup(attention)
    s = Sampler(cfg, params, **KW)
    h = HarnessSampler(s, temperature=0.0)
    ctx = list(PROMPTS[2])
    ids, lps, vers, ex = h(ctx, 5)
    assert len(ids) == len(lps) == len(vers) == 5 and ex.shape == (5, 2, 2)
    assert s.prefill_tokens == len(ctx)
    ctx2 = ctx + ids + [30, 31, 32]            # tool output appended
    ids2, _, _, ex2 = h(ctx2, 4)
    assert s.prefill_tokens == len(ctx) + 3    # only the appended tokens were prefilled
    # equal to a fresh prefill of the whole context, and to the trainer's routing
    fresh = generate(cfg, params, [ctx2], max_new_tokens=4, temperature=0.0, **KW)
    assert fresh.tokens[0][0] == ids2
    _, ref_ex = reference(attention, params, ctx2 + ids2)
    np.testing.assert_array_equal(ex2, ref_ex[len(ctx2):])
    np.testing.assert_array_equal(ex, ref_ex[len(ctx):len(ctx) + 5])
    # an unrelated context takes the other slot, a branch of the first reuses its prefix
    h([5, 6, 7], 2)
    before = s.prefill_tokens
    h(ctx[:6] + [40, 41], 2)
    assert s.prefill_tokens == before + 2


def test_weight_swap_keeps_own_cache_but_not_shared_prefixes():
    """After swap_params a later turn of the same sequence continues on its cache (in flight), but a
    new context that only shares a prefix with an old-weights slot is prefilled fresh: its tokens
    then follow the new weights alone, as their version tag says."""
    cfg, params = setup("gqa")
    new_params = c2jax.models.init_params(cfg, jax.random.key(1))
    s = Sampler(cfg, params, version=0, **KW)
    h = HarnessSampler(s, temperature=0.0)
    ctx = list(PROMPTS[2])
    ids, *_ = h(ctx, 5)
    s.swap_params(new_params, 1)
    sibling = ctx[:6] + [40, 41]
    before = s.prefill_tokens
    sib_ids, _, sib_vers, _ = h(sibling, 3)
    assert s.prefill_tokens == before + len(sibling) and s.stale_prefix_skips >= 1
    assert list(sib_vers) == [1, 1, 1]
    fresh = generate(cfg, new_params, [sibling], max_new_tokens=3, temperature=0.0, **KW)
    assert fresh.tokens[0][0] == sib_ids
    # a later sibling reuses the new-weights slot's prefix
    before = s.prefill_tokens
    h(ctx[:6] + [42], 2)
    assert s.prefill_tokens == before + 1
    # the first sequence's next turn continues on its (old-weights) cache
    before = s.prefill_tokens
    h(ctx + ids + [30, 31, 32], 2)
    assert s.prefill_tokens == before + 3


def test_mla_cache_holds_only_latent_and_rope_key():
    cfg, params = setup("mla")
    s = Sampler(cfg, params, **KW)
    assert s.split_decode  # the cache is kept per layer for the split decode step
    shapes = jax.tree.map(lambda a: a.shape, s.cache)
    assert len(shapes) == cfg.model.num_layers and set(shapes[-1]) == {"latent", "k_rope"}
    assert shapes[-1]["latent"] == (3, 32, cfg.model.kv_lora_rank)
    assert shapes[-1]["k_rope"] == (3, 32, cfg.model.qk_rope_head_dim)
    stacked = jax.tree.map(lambda a: a.shape, Sampler(cfg, params, split_decode=False, **KW).cache)
    assert stacked["moe"]["latent"] == (2, 3, 32, cfg.model.kv_lora_rank)


def test_bad_requests_raise():
    cfg, params = setup("gqa")
    s = Sampler(cfg, params, **KW)
    with pytest.raises(ValueError, match="max_len"):
        s.submit(Request(list(range(32))))
    with pytest.raises(ValueError, match="n="):
        s.submit(Request([1], n=4))
    with pytest.raises(ValueError, match="detokenize"):
        s.submit(Request([1], stop_strings=["x"]))
    with pytest.raises(ValueError, match="num_mtp_layers"):  # MTP drafts need MTP heads
        Sampler(cfg, params, speculative="mtp")


