"""The split-weight decode step (c2jax.sampling.unrolled) reproduces the model's cached forward
(logits, expert ids, caches) for GQA and MLA models with dense + MoE layers; every split weight
is its own buffer; decode_attention equals the batched-matmul attention; the Sampler gives the
same tokens and logprobs with and without the split decode; all-greedy token selection skips
sampling without changing any output."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from small_models import small_model_cfg
from c2jax.ops import attention as attn_lib
from c2jax.ops import attention_xla
from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.models.transformer import layer_counts
from c2jax.sampling import Request, Sampler, select_tokens, unrolled

B, P, S = 3, 5, 16  # rows, prompt length, cache slots


@functools.cache
def setup(attention, tie=False, vocab=97):
    cfg = small_model_cfg(attention, num_layers=3, first_k_dense=1, init_std=0.2, tie_embeddings=tie,
                          vocab_size=vocab)
    return cfg, c2jax.models.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("attention,tie,vocab", [("gqa", False, 97), ("gqa", True, 97), ("mla", False, 97),
                                                 ("gqa", False, 128), ("gqa", True, 128), ("mla", False, 128)])
def test_decode_step_matches_model_cached_step(attention, tie, vocab, wide_cpu_kernels):
    """Vocab 128 packs the output head for the CPU kernel (cpu_kernels.PackedMatrix), 97 cannot."""
    cfg, params = setup(attention, tie, vocab)
    m = cfg.model
    rng = np.random.default_rng(0)
    cache = c2jax.models.init_cache(cfg, B, S)
    prompt = jnp.asarray(rng.integers(0, m.vocab_size, (B, P)), jnp.int32)
    lens = np.array([P, 3, 4])  # rows at different positions
    pos = np.where(np.arange(P)[None] < lens[:, None], np.arange(P)[None], S)
    cache = c2jax.models.forward_with_cache(cfg, params, prompt, pos, cache).cache
    model_step = jax.jit(lambda p, t, q, c: c2jax.models.forward_with_cache(cfg, p, t, q, c))
    split_step = jax.jit(lambda p, t, q, c: unrolled.decode_step(m, p, t, q, c))
    sp = unrolled.split_params(m, params)
    prep = sp.prepared   # the packed weights; sp.params holds no kernel container
    assert not any(isinstance(x, (cpu_kernels.PackedMatrix, cpu_kernels.PackedExperts))
                   for x in jax.tree.leaves(sp.params, is_leaf=lambda x: not isinstance(x, (dict, list))))
    packed_head = isinstance(prep.get("lm_head", {}).get("kernel"), cpu_kernels.PackedMatrix)
    assert packed_head == (vocab == 128) and ("lm_head" in sp.params) == (vocab == 128 or not tie)
    assert isinstance(prep["layers"][-1]["moe"]["experts"], cpu_kernels.PackedExperts)
    if vocab == 128:  # every Linear whose columns are a multiple of 32 is packed
        assert isinstance(prep["layers"][0]["mlp"]["down"]["kernel"], cpu_kernels.PackedMatrix)  # gate: 48 columns, XLA
        assert isinstance(prep["layers"][-1]["attn"]["o_proj"]["kernel"], cpu_kernels.PackedMatrix)
        assert "kernel" not in sp.params["layers"][-1]["attn"]["o_proj"]
    layers = unrolled.split_cache(cache)
    for step in range(3):
        tok = jnp.asarray(rng.integers(0, m.vocab_size, (B, 1)), jnp.int32)
        q = jnp.asarray(lens + step, jnp.int32)[:, None]
        want = model_step(params, tok, q, cache)
        got = split_step(sp, tok, q, layers)
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(got.aux["expert_ids"], want.aux["expert_ids"])
        cache, layers = want.cache, got.cache
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), unrolled.stack_layers(layer_counts(m)[0], layers), cache)


def test_split_params_are_separate_buffers_in_compute_dtype():
    cfg, params = setup("mla")
    m = cfg.model.copy_and_resolve_references()
    m.dtype = "bfloat16"
    sp = unrolled.split_params(m, params)
    assert len(sp.params["layers"]) == m.num_layers and "mlp" in sp.params["layers"][0]
    experts = sp.prepared["layers"][1]["moe"]["experts"]
    assert len(experts) == m.num_experts and experts[0][0].shape == (m.hidden_size, 2 * m.moe_intermediate_size)
    assert experts[0][0].dtype == jnp.bfloat16 and sp.params["layers"][1]["moe"]["router"].dtype == jnp.float32
    np.testing.assert_array_equal(experts[3][1].astype(jnp.float32),
                                  params["moe_layers"]["block"]["moe"]["w_down"][0, 3].astype(jnp.bfloat16)
                                  .astype(jnp.float32))
    ptrs = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(sp)]
    assert len(set(ptrs)) == len(ptrs)
    m.quant = "int8"
    with pytest.raises(ValueError, match="quantized"):
        unrolled.split_params(m, params)


@pytest.mark.parametrize("L", [1, 3])
def test_decode_attention_equals_dot_product_attention(L):
    rng = np.random.default_rng(L)
    Bq, Sk, H, G, Pd = 2, 11, 6, 3, 8
    q = jnp.asarray(rng.standard_normal((Bq, L, H, Pd)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((Bq, Sk, G, Pd)), jnp.float32) for _ in range(2))
    qpos = jnp.asarray(rng.integers(0, Sk, (Bq, L)), jnp.int32)
    mask = attention_xla.attention_mask(qpos, jnp.broadcast_to(jnp.arange(Sk), (Bq, Sk)))
    got = attention_xla.decode_attention_reduce(q, k, v, mask, 0.3)
    want = attention_xla.dot_product_attention(q, k, v, mask, 0.3)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention,max_len,lens,new", [("gqa", 32, (4, 6), 7), ("gqa", 320, (4, 119), 24),
                                                       ("mla", 320, (30, 121), 24)])
def test_sampler_split_decode_equals_model_decode(attention, max_len, lens, new, wide_cpu_kernels):
    """A greedy and a sampled (temperature 1) request, two samples each, through both decodes.
    At max_len 320 the split decode attends over a span of the cache (128, then 256 once a row
    nears 128; the first chunk is forced to a span the rows outgrow, so the loop's guard stops it)."""
    cfg, params = setup(attention)
    prompts = [np.random.default_rng(i).integers(0, 97, n).tolist() for i, n in enumerate(lens)]
    outs, spans = [], []
    for split in (True, False):
        s = Sampler(cfg, params, max_batch=4, max_len=max_len, chunk=8, split_decode=split)
        assert s.split_decode == split
        decode = s._decode

        def spy(*a, **k):
            if "span" in k:
                k["span"] = min(k["span"], 128) if not spans else k["span"]
                spans.append(k["span"])
            return decode(*a, **k)
        s._decode = spy
        rids = [s.submit(Request(p, max_new_tokens=new, temperature=float(i), n=2, seed=1, request_id=i))
                for i, p in enumerate(prompts)]
        s.run_until_done()
        outs.append([c for r in rids for c in s.results(r)])
    assert spans and all(sp < max_len for sp in spans) == (max_len > 128)
    if max_len > 128:
        assert spans[0] == 128 and 256 in spans
    for a, b in zip(*outs):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)


def test_all_greedy_selection_equals_mixed_selection_rows():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((4, 50)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    zeros_k, ones_p = jnp.zeros((4,), jnp.int32), jnp.ones((4,), jnp.float32)
    greedy = select_tokens(logits, keys, jnp.zeros((4,)), zeros_k, ones_p)
    mixed = select_tokens(logits, keys, jnp.asarray([0.0, 1.0, 0.0, 0.5]), zeros_k, ones_p)
    np.testing.assert_array_equal(greedy[0], jnp.argmax(logits, -1))
    np.testing.assert_array_equal(greedy[1], 0.0)
    for i in (0, 2):
        assert int(mixed[0][i]) == int(greedy[0][i]) and float(mixed[1][i]) == 0.0
        np.testing.assert_allclose(mixed[2][i], greedy[2][i])
    np.testing.assert_allclose(greedy[2], jax.nn.log_softmax(logits)[jnp.arange(4), greedy[0]], rtol=1e-6)


@pytest.mark.parametrize("B,L", [(3, 1), (2, 3), (20, 1)])
def test_decode_write_cache_equals_scatter(B, L):
    """The in-place few-token cache write (unrolled, and fori_loop above 16 entries) equals the
    batched scatter, out-of-range positions dropped and negative ones counted from the end."""
    rng = np.random.default_rng(B)
    Sk = 9
    cache = jnp.asarray(rng.standard_normal((B, Sk, 2, 3)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((B, L, 2, 3)), jnp.float32)
    pos = np.stack([rng.choice(np.arange(-2, Sk + 3), L, replace=False) for _ in range(B)])
    pos[0, 0] = Sk  # the sampler's idle rows
    want = jax.vmap(lambda c, n, p: c.at[p].set(n, mode="drop"))(cache, new, jnp.asarray(pos))
    got = jax.jit(attn_lib.write_cache)(cache, new, jnp.asarray(pos, jnp.int32))
    np.testing.assert_array_equal(got, want)
