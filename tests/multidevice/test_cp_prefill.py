"""Prefill into a KV cache under context parallelism (8 fake CPU devices): the prompt's tokens are
sharded over the context ranks (2*CP zigzag via `context_prefill`), each rank attends its queries
against the gathered K/V (GQA) or latents (MLA), and the written cache equals the single-device
prefill's; greedy decoding continues from it exactly."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.config import load_config
from c2jax.models import param_shardings
from c2jax.parallel import activate, make_mesh
from c2jax.ops import attention_cp as cpmod
from c2jax.models.transformer import context_prefill as tfm_context_prefill

B, L, S, STEPS = 4, 32, 48, 3
CONFIGS = {"gqa": "configs/tiny.py", "mla": "configs/tiny.py:mla"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def _cfg(attention, shape=(1, 1, 1, 1), attention_chunk=0):
    cfg = load_config(os.path.join(ROOT, CONFIGS[attention]))
    cfg.model.dtype = cfg.model.param_dtype = "float32"
    # dropless MoE: capacity dispatch drops tokens by their order, which the zigzag changes
    cfg.model.moe_dispatch = "dropless"
    cfg.mesh.shape = shape
    cfg.mesh.attention_chunk = attention_chunk   # local queries in chunks (CP prefill too)
    return cfg


def _prompt(seed, length=L):
    return jnp.asarray(np.random.default_rng(seed).integers(1, 1024, (B, length)), jnp.int32)


def _positions(start, length):
    return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (B, length))


def _decode(cfg, params, cache, logits, start):
    """STEPS greedy steps from the prefill's last logits; returns (tokens, logits per step, cache)."""
    step = jax.jit(functools.partial(c2jax.models.forward_with_cache, cfg))
    tok = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
    toks, outs = [tok], []
    for i in range(STEPS):
        out = step(params, tok, _positions(start + i, 1), cache)
        cache = out.cache
        outs.append(out.logits)
        tok = jnp.argmax(out.logits[:, -1], -1)[:, None].astype(jnp.int32)
        toks.append(tok)
    return jax.device_get(jnp.concatenate(toks, 1)), jax.device_get(jnp.stack(outs)), cache


@functools.cache
def _reference(attention, length=L, seed=1):
    """Single-device prefill of a fresh cache, then greedy decode."""
    cfg = _cfg(attention)
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    with activate(cfg, make_mesh(cfg, jax.devices()[:1])):
        cache = c2jax.models.init_cache(cfg, B, S, jnp.float32)
        out = jax.jit(functools.partial(c2jax.models.forward_with_cache, cfg))(
            params, _prompt(seed, length), _positions(0, length), cache)
        toks, dec_logits, _ = _decode(cfg, params, out.cache, out.logits, length)
    return params, jax.device_get((out.logits, out.cache)), toks, dec_logits


def _rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _assert_cache_equal(cache, ref):
    errs = jax.tree.map(_rel_err, jax.device_get(cache), ref)
    assert max(jax.tree.leaves(errs)) <= 1e-5, errs


@pytest.fixture
def prefill_calls(monkeypatch):
    """Counts trace-time calls of the CP prefill attention (proves the CP path ran)."""
    calls = []
    for name in ("gqa_context_prefill", "mla_context_prefill"):
        fn = getattr(cpmod, name)
        monkeypatch.setattr(cpmod, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n), _fn(*a, **k))[1])
    return calls


# data2 x context4; fsdp2 x context2 x expert2 (EP over expert) with the local 16 queries in 2 chunks
MESHES = [((2, 1, 4, 1), 0), ((1, 2, 2, 2), 8)]


@pytest.mark.parametrize("shape,attention_chunk", MESHES)
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_cp_prefill_matches_single_device(attention, shape, attention_chunk, prefill_calls):
    assert jax.device_count() == 8
    params, (ref_logits, ref_cache), ref_toks, ref_dec = _reference(attention)
    cfg = _cfg(attention, shape, attention_chunk)
    mesh = make_mesh(cfg)
    with activate(cfg, mesh):
        sharded = jax.device_put(params, param_shardings(cfg, mesh))
        cache = c2jax.models.init_cache(cfg, B, S, jnp.float32)
        out = jax.jit(functools.partial(tfm_context_prefill, cfg))(sharded, _prompt(1), _positions(0, L), cache)
        assert prefill_calls, "the CP prefill path did not run"
        assert _rel_err(out.logits, ref_logits) <= 1e-5
        _assert_cache_equal(out.cache, ref_cache)
        # decode (one token per row: the decode path) continues from the CP-written cache
        toks, dec_logits, _ = _decode(cfg, sharded, out.cache, out.logits, L)
    np.testing.assert_array_equal(toks, ref_toks)
    assert _rel_err(dec_logits, ref_dec) <= 1e-5


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_cp_prefill_unpermuted_chunked_and_padded(attention, prefill_calls):
    """forward_with_cache itself under CP (natural token order: exact, only without the zigzag
    balance); a prompt prefilled in two chunks (the second over a non-empty cache prefix); and
    a prompt length that is not a multiple of 2*CP (context_prefill pads it)."""
    params, (ref_logits, ref_cache), _, _ = _reference(attention)
    cfg = _cfg(attention, (2, 1, 4, 1))
    mesh = make_mesh(cfg)
    fwc = jax.jit(functools.partial(c2jax.models.forward_with_cache, cfg))
    prompt = _prompt(1)
    with activate(cfg, mesh):
        sharded = jax.device_put(params, param_shardings(cfg, mesh))
        fresh = c2jax.models.init_cache(cfg, B, S, jnp.float32)
        out = fwc(sharded, prompt, _positions(0, L), fresh)
        assert prefill_calls
        assert _rel_err(out.logits, ref_logits) <= 1e-5
        _assert_cache_equal(out.cache, ref_cache)
        # chunked: 16 + 16 tokens, the second chunk attends over the first one's cache entries
        prefill = jax.jit(functools.partial(tfm_context_prefill, cfg))
        first = prefill(sharded, prompt[:, :16], _positions(0, 16), fresh)
        second = prefill(sharded, prompt[:, 16:], _positions(16, 16), first.cache)
        logits = jnp.concatenate([first.logits, second.logits], 1)
        assert _rel_err(logits, ref_logits) <= 1e-5
        _assert_cache_equal(second.cache, ref_cache)
    # padded: 27 tokens on CP 4 (2*CP = 8 does not divide 27)
    _, (ref27_logits, ref27_cache), ref27_toks, ref27_dec = _reference(attention, 27, 2)
    with activate(cfg, mesh):
        out = jax.jit(functools.partial(tfm_context_prefill, cfg))(
            sharded, _prompt(2, 27), _positions(0, 27), c2jax.models.init_cache(cfg, B, S, jnp.float32))
        assert out.logits.shape == (B, 27, cfg.model.vocab_size)
        assert _rel_err(out.logits, ref27_logits) <= 1e-5
        _assert_cache_equal(out.cache, ref27_cache)
        toks, dec_logits, _ = _decode(cfg, sharded, out.cache, out.logits, 27)
    np.testing.assert_array_equal(toks, ref27_toks)
    assert _rel_err(dec_logits, ref27_dec) <= 1e-5
