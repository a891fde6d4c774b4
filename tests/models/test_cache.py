"""KV cache: prefill + step-by-step decode reproduce the full forward (GQA and MLA), rows may sit at
different positions (ragged, padded prompts), MLA caches only the latent and the rotary key, and
the cached path routes every token to the same experts as the full forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from small_models import small_model_cfg

ATTENTIONS = ["gqa", "mla"]
B, L, P, S = 2, 10, 6, 16   # batch, full length, prefill length, cache slots
_MEMO = {}


def _memo(key, make):
    if key not in _MEMO:
        _MEMO[key] = make()
    return _MEMO[key]


def small_cfg(attention):
    """configs/tiny.py shrunk; dropless dispatch so decoding one token per row drops nothing."""
    return _memo(("cfg", attention), lambda: small_model_cfg(attention))


def make_params(cfg, seed=0):
    """Random params of the model's structure, filled on the host (no init compile)."""
    m = cfg.model
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name == "scale":
            value = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif name == "router_bias":
            value = 0.05 * rng.standard_normal(leaf.shape)
        else:
            value = m.init_std * rng.standard_normal(leaf.shape)
        return jnp.asarray(value, leaf.dtype)

    return _memo(("params", m.attention), lambda: jax.tree_util.tree_map_with_path(
        fill, c2jax.models.abstract_params(cfg)))


def fns(cfg):
    def full(params, tokens):
        out = c2jax.models.forward(cfg, params, tokens, return_aux=True)
        return out.logits, out.aux["expert_ids"]

    def cached(params, tokens, positions, cache):
        out = c2jax.models.forward_with_cache(cfg, params, tokens, positions, cache)
        return out.logits, out.aux["expert_ids"], out.cache

    return _memo(("fns", cfg.model.attention), lambda: (jax.jit(full), jax.jit(cached)))


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("prompt_lens,pad", [((6, 6), "none"), ((6, 3), "overwrite"), ((4, 6), "drop")])
def test_prefill_then_decode_matches_forward(attention, prompt_lens, pad):
    """Row r has a prompt of prompt_lens[r] tokens, prefilled in one [B, P] call (shorter prompts
    padded with junk tokens, written either at the following positions, to be overwritten by
    decode, or at positions >= S, which the cache drops), then decodes L - P tokens one at a time,
    each row at its own position."""
    cfg = small_cfg(attention)
    params = make_params(cfg)
    full_fn, cached_fn = fns(cfg)
    V = cfg.model.vocab_size
    seq = jax.random.randint(jax.random.key(1), (B, L), 0, V, dtype=jnp.int32)
    junk = jax.random.randint(jax.random.key(2), (B, P), 0, V, dtype=jnp.int32)
    ref_logits, ref_ids = full_fn(params, seq)  # tokens past a row's sequence cannot affect it (causal)

    lens = np.array(prompt_lens)
    col = np.arange(P)[None]
    prompt = jnp.where(col < lens[:, None], seq[:, :P], junk)
    positions = np.broadcast_to(col, (B, P)).copy()
    if pad == "drop":
        positions[col.repeat(B, 0) >= lens[:, None]] = S + 3
    cache = c2jax.models.init_cache(cfg, B, S)
    logits, ids, cache = cached_fn(params, prompt, jnp.asarray(positions, jnp.int32), cache)
    for r in range(B):
        n = lens[r]
        np.testing.assert_allclose(np.asarray(logits[r, :n]), np.asarray(ref_logits[r, :n]), atol=1e-4, rtol=0)
        np.testing.assert_array_equal(np.asarray(ids[:, r, :n]), np.asarray(ref_ids[:, r, :n]))

    for step in range(L - P):
        pos = lens + step
        tok = seq[jnp.arange(B), pos][:, None]
        logits, ids, cache = cached_fn(params, tok, jnp.asarray(pos[:, None], jnp.int32), cache)
        for r in range(B):
            np.testing.assert_allclose(np.asarray(logits[r, 0]), np.asarray(ref_logits[r, pos[r]]),
                                       atol=1e-4, rtol=0)
            np.testing.assert_array_equal(np.asarray(ids[:, r, 0]), np.asarray(ref_ids[:, r, pos[r]]))
    # Non-vacuous: the decoded logits depend on the cache contents (an empty cache gives others).
    empty_logits, _, _ = cached_fn(params, tok, jnp.asarray(pos[:, None], jnp.int32),
                                   c2jax.models.init_cache(cfg, B, S))
    assert float(jnp.max(jnp.abs(empty_logits - logits))) > 1e-3


def _shapes(tree):
    return {"/".join(str(k.key) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_cache_layout(attention):
    cfg = small_cfg(attention)
    m = cfg.model
    n_dense, n_moe = c2jax.models.layer_counts(m)
    cache = c2jax.models.init_cache(cfg, B, S)
    if attention == "mla":
        # Only the kv latent C and the shared rotary key R per token: no per-head K/V.
        want = {"latent": (B, S, m.kv_lora_rank), "k_rope": (B, S, m.qk_rope_head_dim)}
        per_token = m.kv_lora_rank + m.qk_rope_head_dim
    else:
        want = {"k": (B, S, m.num_kv_heads, m.head_dim), "v": (B, S, m.num_kv_heads, m.head_dim)}
        per_token = 2 * m.num_kv_heads * m.head_dim
    expected = {}
    for stack, n in (("dense", n_dense), ("moe", n_moe)):
        if n:
            expected.update({f"{stack}/{k}": (n,) + v for k, v in want.items()})
    assert _shapes(cache) == expected
    total = sum(x.size for x in jax.tree.leaves(cache))
    assert total == m.num_layers * B * S * per_token
    # forward_with_cache returns a cache of the same layout (abstractly: no compile needed).
    tokens = jnp.zeros((B, 3), jnp.int32)
    out = jax.eval_shape(lambda p, c: c2jax.models.forward_with_cache(cfg, p, tokens, tokens, c),
                         c2jax.models.abstract_params(cfg), cache)
    assert _shapes(out.cache) == expected
    assert all(a.dtype == b.dtype for a, b in zip(jax.tree.leaves(out.cache), jax.tree.leaves(cache)))


def test_gather_dispatch_equals_grouped_dispatch():
    """The few-token path (reads only the chosen experts' weights) equals dropless grouped
    dispatch, values and gradients, on fresh random inputs."""
    from c2jax.ops import experts_xla
    rng = np.random.default_rng(3)
    T, D, F, E, K = 3, 16, 24, 8, 2
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    ws = [jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]

    def loss(fn, x, *w):
        return jnp.sum(jnp.sin(fn(x, ids, wts, *w)[0]))
    a = experts_xla.gather_dispatch(x, ids, wts, *ws)[0]
    b = experts_xla.grouped_dispatch(x, ids, wts, *ws)[0]
    np.testing.assert_allclose(a, b, atol=1e-5)
    ga = jax.grad(lambda *a: loss(experts_xla.gather_dispatch, *a), argnums=(0, 1, 2, 3))(x, *ws)
    gb = jax.grad(lambda *a: loss(experts_xla.grouped_dispatch, *a), argnums=(0, 1, 2, 3))(x, *ws)
    for u, v in zip(ga, gb):
        np.testing.assert_allclose(u, v, atol=1e-5)
