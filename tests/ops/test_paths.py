"""The choices the model used to make itself now belong to c2jax.ops: which attention path a layer
takes (cache or none, query count, context parallelism), which experts implementation reads a
weight layout (the sampler's decode layouts included, whatever the config pins), which decode
layout a sampler stores, and which embedding lookup runs; `python -m c2jax.ops` lists them all."""
import contextlib
import io

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from c2jax.ops import KernelUnavailable, Target, load_all, record_choices
from c2jax.ops import __main__ as ops_main
from c2jax.ops import attention as attention_ops
from c2jax.ops import embed as embed_ops
from c2jax.ops import experts as experts_ops
from c2jax.ops import experts_xla

CPU, TPU = Target("cpu"), Target("tpu")


@pytest.mark.parametrize("cache,cp,L,gqa,mla", [
    (False, False, 64, "packed", "packed"),
    (False, True, 64, "context_parallel", "context_parallel"),
    (True, False, 1, "cache_decode", "latent_cache"),
    (True, False, 64, "cache_prefill", "latent_cache"),
    (True, True, 64, "context_prefill", "context_prefill"),
])
def test_attention_path_follows_from_the_call(cache, cp, L, gqa, mla):
    spec = dict(cache=cache, cp=cp, L=L)
    assert attention_ops.GQA_ATTENTION.select("auto", TPU, **spec).name == gqa
    assert attention_ops.MLA_ATTENTION.select("auto", CPU, **spec).name == mla


def test_a_path_that_does_not_fit_the_call_says_why():
    with pytest.raises(KernelUnavailable, match="a KV cache path"):
        attention_ops.GQA_ATTENTION.select("cache_decode", CPU, cache=False, cp=False, L=1)


def test_gqa_cache_paths_are_recorded_and_match_the_masked_product():
    rng = np.random.default_rng(0)
    B, L, S, H, G, P = 2, 3, 16, 4, 2, 8
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = arr(B, L, H, P), arr(B, L, G, P), arr(B, L, G, P)
    pos = jnp.asarray([[4, 5, 6], [0, 1, 2]], jnp.int32)
    cache = {"k": arr(B, S, G, P), "v": arr(B, S, G, P)}
    with record_choices() as rec:
        out, new = attention_ops.gqa_attention(None, q, k, v, pos, jnp.ones_like(pos), 0.3, jnp.float32, cache)
    assert rec["gqa_attention"] == {"cache_decode": 1}
    np.testing.assert_array_equal(new["k"][0, 4:7], k[0])
    mask = attention_ops.attention_mask(pos, jnp.broadcast_to(jnp.arange(S), (B, S)))
    want = attention_ops.xla.dot_product_attention(q, new["k"], new["v"], mask, 0.3)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def _experts(rng, E=4, D=16, F=8):
    return tuple(jnp.asarray(rng.standard_normal(s) / 4, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D)))


def test_weight_layouts():
    rng = np.random.default_rng(1)
    ws = _experts(rng)
    assert experts_ops.weight_layout(ws) == "float"
    assert experts_ops.weight_layout(experts_xla.split_experts(*ws)) == "split"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("decode",))
    assert experts_ops.weight_layout(experts_xla.shard_experts(*ws, mesh)) == "sharded"


def test_a_decode_layout_runs_its_own_implementation_whatever_the_config_pins():
    rng = np.random.default_rng(2)
    ws = _experts(rng, E=8)
    x = jnp.asarray(rng.standard_normal((1, 3, 16)), jnp.float32)
    ids = jnp.asarray([[[0, 2], [1, 3], [2, 0]]], jnp.int32)
    wts = jnp.full((1, 3, 2), 0.5, jnp.float32)
    with record_choices() as rec:
        got, dropped = experts_ops.experts({"experts": "xla_blocks"}, x, ids, wts, experts_xla.split_experts(*ws))
        want, _ = experts_ops.experts({"experts": "xla_gather"}, x, ids, wts, *ws)
    assert rec["experts"] == {"decode_split": 1, "xla_gather": 1} and float(dropped) == 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelUnavailable, match="'split' decode layout"):
        experts_ops.EXPERTS.select("xla_gather", CPU, layout="split", T=3, K=2)


def test_decode_layout_comes_from_the_target():
    m = ml_collections.ConfigDict({"num_experts": 8, "hidden_size": 64, "moe_intermediate_size": 64,
                                   "dtype": "float32"})
    assert experts_ops.decode_layout(TPU, m) == "float"
    assert experts_ops.decode_layout(Target("gpu"), m) == "float"
    assert experts_ops.decode_layout(CPU, m) in ("split", "packed")
    m.dtype = "bfloat16"
    assert experts_ops.decode_layout(CPU, m) == "split"


def test_embedding_lookup_off_a_mesh_is_a_take():
    table = jnp.arange(12.0).reshape(6, 2)
    with record_choices() as rec:
        out = embed_ops.embed_lookup(table, jnp.asarray([[5, 0]]), jnp.float32)
    assert rec["embed"] == {"take": 1}
    np.testing.assert_array_equal(out[0], table[jnp.asarray([5, 0])])


def test_python_m_ops_lists_every_path():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ops_main.main()
    text = out.getvalue()
    for name, op in load_all().items():
        assert f"{name}:" in text
        for impl in list(op.impls) + [f"{p}(...)" for p in op.paths]:
            assert impl in text, (name, impl)
    for path in ("ep_all_to_all(...)", "token_parallel(...)", "decode_cpu_packed", "context_prefill", "cache_decode"):
        assert path in text
