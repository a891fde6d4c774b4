"""c2jax.ops: which implementation runs, per op and target; pinned names that cannot run fail with
their reason; every runnable implementation of an op agrees with the XLA reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.config import KERNEL_OPS, default_config
from c2jax.ops import KernelUnavailable, Target, load_all, record_choices
from c2jax.ops import attention as attention_ops
from c2jax.ops import experts as experts_ops
from c2jax.ops import experts_xla
from c2jax.ops import layers as layer_ops

TPU, GPU, CPU = Target("tpu"), Target("gpu"), Target("cpu")


def test_every_config_op_has_a_registry_with_auto_rules():
    ops = load_all()
    for op in KERNEL_OPS:
        assert op in ops, op
        for platform in ("cpu", "gpu", "tpu"):
            order = ops[op].auto.get(platform, ()) + ops[op].auto.get("*", ())
            assert order and all(name in ops[op].impls for name in order), (op, platform)


def _expert_spec(**kw):
    spec = dict(T=256, K=2, E=8, D=64, F=64, quant="none", ep=False, x_dtype=jnp.float32,
                w_dtype=jnp.float32)
    spec.update(kw)
    return spec


def test_auto_table_per_target():
    E = experts_ops.EXPERTS
    assert E.select("auto", TPU, **_expert_spec()).name == "pallas_gmm"
    assert E.select("auto", TPU, **_expert_spec(quant="mxfp8")).name == "pallas_gmm"
    assert E.select("auto", GPU, **_expert_spec()).name == "xla_ragged"             # dropless
    assert E.select("auto", GPU, **_expert_spec(capacity=True)).name == "xla_capacity"     # opted-in capacity
    assert E.select("auto", CPU, **_expert_spec(T=2)).name == "xla_gather"          # decode: T * K < E
    assert E.select("auto", CPU, **_expert_spec(ep=True)).name == "xla_grouped"
    assert E.select("auto", Target("cpu", (("data", 2),)), **_expert_spec()).name == "xla_blocks"
    A = attention_ops.ATTENTION
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    assert A.select("auto", TPU, q=q, k=q, v=q, cp=False).name == "pallas_flash"
    assert A.select("auto", TPU, q=q, k=q, v=q, cp=True).name == "pallas_flash"    # local attention of CP ranks
    assert A.select("auto", TPU, q=q, k=q, v=q, cp=True, ring=True).name == "xla_blocked"
    with pytest.raises(KernelUnavailable, match="ring context parallelism"):
        A.select("pallas_flash", TPU, q=q, k=q, v=q, cp=True, ring=True)
    assert A.select("auto", GPU, q=q, k=q, v=q, cp=False).name == "xla_blocked"    # float32: not cuDNN's
    qb = q.astype(jnp.bfloat16)
    assert A.select("auto", GPU, q=qb, k=qb, v=qb, cp=False).name == "cudnn"
    assert A.select("auto", GPU, q=qb, k=qb, v=qb[..., :8], cp=False).name == "xla_blocked"   # MLA: v dim != q dim
    with pytest.raises(KernelUnavailable, match="cuDNN runs on GPU"):
        A.select("cudnn", CPU, q=qb, k=qb, v=qb, cp=False)
    D = attention_ops.DECODE_ATTENTION
    assert D.select("auto", TPU, L=1).name == "pallas"
    assert D.select("auto", TPU, L=3).name == "xla"
    assert D.select("auto", CPU, L=1).name == "xla_reduce"
    assert layer_ops.MATMUL.select("auto", TPU, layout="plain").name == "xla"
    assert layer_ops.NORM.select("auto", GPU, x=q, weight=q[0, 0, 0], rope=False).name == "xla"


def test_auto_passes_over_the_cpu_product_kernels_on_narrow_vector_hosts(monkeypatch):
    from c2jax.backends.cpu import kernels as cpu_kernels
    from c2jax.sampling import unrolled
    import ml_collections
    A = attention_ops.ATTENTION
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    m = ml_collections.ConfigDict({"num_experts": 8, "hidden_size": 64, "moe_intermediate_size": 64,
                                   "dtype": "float32"})
    for wide, env in ((True, "wide"), (False, "1")):
        monkeypatch.setenv("C2JAX_CPU_KERNELS", env)
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : fpu avx2 fma")
        cpu_kernels.narrow_vectors.cache_clear()
        auto = A.select("auto", CPU, q=q, k=q, v=q, cp=False).name
        experts = experts_ops.EXPERTS.select("auto", CPU, **_expert_spec(capacity=True)).name
        layout = unrolled.decode_layout(m)
        if wide:
            assert (auto, experts) == ("cpu_ffi", "cpu_ffi")
        else:
            assert (auto, experts, layout) == ("xla_blocked", "xla_blocks", "split")
            # pinned, it still runs: the rule is a measured preference, not a capability
            assert A.select("cpu_ffi", CPU, q=q, k=q, v=q, cp=False).name == "cpu_ffi"
    cpu_kernels.narrow_vectors.cache_clear()


def test_pinned_implementation_that_cannot_run_names_the_reason():
    with pytest.raises(KernelUnavailable, match="model.kernels.experts='pallas_gmm'.*Mosaic kernels run on TPU"):
        experts_ops.EXPERTS.select("pallas_gmm", CPU, **_expert_spec())
    with pytest.raises(KernelUnavailable, match="cpu_ffi.*not float32"):
        experts_ops.EXPERTS.select("cpu_ffi", CPU, **_expert_spec(x_dtype=jnp.bfloat16))
    with pytest.raises(KernelUnavailable, match="not an implementation of experts"):
        experts_ops.EXPERTS.select("no_such_kernel", CPU, **_expert_spec())
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(KernelUnavailable, match="CPU only \\(target is tpu\\)"):
        attention_ops.ATTENTION.select("cpu_ffi", TPU, q=q, k=q, v=q, cp=False)


def test_config_rejects_unknown_op_and_a_pinned_name_fails_at_trace_with_its_reason():
    from c2jax.config import ConfigError, validate
    cfg = default_config()
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    cfg.model.kernels.experts = "pallas_gmm"          # a TPU kernel, traced on CPU
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 16)), jnp.int32)
    with pytest.raises(KernelUnavailable, match="Mosaic kernels run on TPU"):
        c2jax.models.forward(cfg, params, tokens)
    bad = default_config()
    bad.model.kernels["flash"] = "auto"
    with pytest.raises(ConfigError, match="model.kernels has unknown ops"):
        validate(bad)


def _dense_reference(x_TD, ids_TK, weights_TK, w_gate, w_up, w_down):
    """float64 numpy: every expert on every token, masked by the routing."""
    x, wg, wu, wd, w = (np.asarray(a, np.float64) for a in (x_TD, w_gate, w_up, w_down, weights_TK))
    g, u = np.einsum("td,edf->etf", x, wg), np.einsum("td,edf->etf", x, wu)
    y_ETD = np.einsum("etf,efd->etd", g / (1 + np.exp(-g)) * u, wd)
    onehot_TKE = np.asarray(ids_TK)[..., None] == np.arange(wg.shape[0])
    return np.einsum("tke,etd,tk->td", onehot_TKE, y_ETD, w)


def _routed(T, K, E, D, F, seed, skew=0.0):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, D), jnp.float32)
    logits = jax.random.normal(ks[1], (T, E)) + skew * (jnp.arange(E) == 0)
    ids = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(ks[2], (T, K)), -1)
    ws = [jax.random.normal(k, s, jnp.float32) * 0.1 for k, s in zip(ks[3:], ((E, D, F), (E, D, F), (E, F, D)))]
    return x, ids, wts, ws


@pytest.mark.parametrize("name", ["xla_grouped", "xla_ragged", "pallas_gmm_interpret", "xla_gather", "xla_blocks", "cpu_ffi",
                                  "xla_capacity"])
def test_every_expert_implementation_is_dropless_by_default_and_matches_the_dense_reference(name):
    """Skewed routing (most tokens pick expert 0): dropless implementations must not drop."""
    T, K, E, D, F = (3, 2, 8, 64, 64) if name == "xla_gather" else (48, 2, 8, 64, 64)
    x, ids, wts, ws = _routed(T, K, E, D, F, 3, skew=4.0)
    if name == "cpu_ffi":
        from c2jax.backends.cpu import kernels
        if kernels.unavailable():
            pytest.skip(f"CPU kernels unavailable: {kernels.unavailable()}")
    factor = 4.0 if name == "xla_capacity" else None     # capacity = T with factor E / K: nothing to drop
    with record_choices() as rec:
        y, dropped = experts_ops.experts({"experts": name}, x[None], ids[None], wts[None], *ws, capacity_factor=factor)
    assert rec["experts"] == {name: 1}
    assert float(dropped) == 0.0
    want = _dense_reference(x, ids, wts, *ws)
    np.testing.assert_allclose(np.asarray(y[0]), np.asarray(want), rtol=2e-4, atol=2e-5)


def test_ragged_dot_experts_gradients_match_the_row_tiled_grouped_matmul():
    """xla_ragged (GPU's dropless path: ragged_dot forward, ragged contraction for dW) against the
    row-tiled XLA grouped matmul, values and gradients of every input."""
    x, ids, wts, ws = _routed(40, 2, 8, 32, 48, 5, skew=2.0)

    def loss(name, x, wts, *ws):
        y, _ = experts_ops.experts({"experts": name}, x[None], ids[None], wts[None], *ws)
        return jnp.sum(jnp.sin(y))
    grads = {name: jax.jit(jax.value_and_grad(lambda *a, n=name: loss(n, *a), argnums=(0, 1, 2, 3, 4)))(x, wts, *ws)
             for name in ("xla_grouped", "xla_ragged")}
    (v0, g0), (v1, g1) = grads["xla_grouped"], grads["xla_ragged"]
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("quant", ["none", "mxfp8"])
def test_joined_gate_up_matches_separate_products(quant):
    """expert_ffn with gate and up joined into one [D, 2F] grouped matmul (the EP path's form;
    float, or pre-quantized QuantizedExperts joined leaf by leaf) against two products: values
    and gradients of the rows and every weight."""
    import pallas_kernels as pk
    x, ids, _, (wg, wu, wd) = _routed(48, 2, 4, 64, 64, 7)
    order, sizes = experts_xla.sort_assignments(ids, 4)
    x_M = x[order // 2]
    gmm = experts_xla.grouped_matmul(quant, "xla")
    if quant != "none":    # the sampler's stored form: gmm reads quantized values as rhs
        q = [pk.quantize_experts(w, quant) for w in (wg, wu, wd)]
        sep = experts_xla.expert_ffn(x_M, *q, sizes, gmm)
        joined = experts_xla.expert_ffn(x_M, experts_xla.join_gate_up(q[0], q[1]), None, q[2], sizes, gmm)
        np.testing.assert_allclose(np.asarray(joined), np.asarray(sep), rtol=1e-5, atol=1e-5)
        return

    def loss(join, x_M, wg, wu, wd):
        ws = (experts_xla.join_gate_up(wg, wu), None) if join else (wg, wu)
        return jnp.sum(jnp.sin(experts_xla.expert_ffn(x_M, *ws, wd, sizes, gmm)))
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(lambda *a, j=j: loss(j, *a), argnums=(0, 1, 2, 3)))(x_M, wg, wu, wd)
                          for j in (False, True))
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_capacity_is_an_opt_in_that_reports_drops():
    x, ids, wts, ws = _routed(256, 2, 8, 64, 64, 4, skew=4.0)
    assert experts_xla.capacity(256, 2, 8, None) == 256
    y, dropped = experts_ops.experts({"experts": "xla_blocks"}, x[None], ids[None], wts[None], *ws, capacity_factor=1.0)
    assert float(dropped) > 0.2


def test_public_forward_is_dropless_even_with_a_capacity_training_config():
    cfg = default_config()
    cfg.model.moe_dispatch, cfg.model.capacity_factor = "capacity", 0.1
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 100, (4, 128)), jnp.int32)
    out = c2jax.models.forward(cfg, params, tokens, return_aux=True)
    assert float(jnp.max(out.aux["dropped_fraction"])) == 0.0
    train = c2jax.models.forward(cfg, params, tokens, return_aux=True, train_dispatch=True)
    assert float(jnp.max(train.aux["dropped_fraction"])) > 0.0


@pytest.mark.parametrize("name", ["xla_blocked", "xla_dense", "xla_sdpa", "cpu_ffi", "pallas_flash_interpret"])
def test_attention_implementations_agree(name):
    if name == "cpu_ffi":
        from c2jax.backends.cpu import kernels
        if kernels.unavailable():
            pytest.skip("CPU kernels unavailable")
    B, L, H, G, P = 2, 32, 4, 2, 16
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (B, L, H, P))
    k = jax.random.normal(ks[1], (B, L, G, P))
    v = jax.random.normal(ks[2], (B, L, G, P))
    pos = jnp.asarray(np.concatenate([np.arange(20), np.arange(12)]))[None].repeat(B, 0)
    seg = jnp.asarray(np.repeat([1, 2], [20, 12]))[None].repeat(B, 0)
    want = attention_ops._xla_dense(q, k, v, pos, seg, 0.25)
    with record_choices() as rec:
        got = attention_ops.attention({"attention": name}, q, k, v, pos, seg, 0.25)
    assert rec == {"attention": {name: 1}}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["xla", "xla_reduce", "pallas_interpret"])
def test_decode_attention_implementations_agree(name):
    B, S, H, G, P = 3, 64, 4, 2, 16
    ks = jax.random.split(jax.random.key(6), 3)
    q = jax.random.normal(ks[0], (B, 1, H, P))
    k = jax.random.normal(ks[1], (B, S, G, P))
    v = jax.random.normal(ks[2], (B, S, G, P))
    pos = jnp.asarray([[5], [40], [63]], jnp.int32)
    want = attention_ops._decode_xla(q, k, v, pos, 0.25)
    with record_choices() as rec:
        got = attention_ops.decode_attention({"decode_attention": name}, q, k, v, pos, 0.25)
    assert rec == {"decode_attention": {name: 1}}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["xla_absorbed", "pallas_interpret"])
def test_mla_cache_attention_implementations_agree(name):
    """Against the unabsorbed form: per-head keys [latent @ W_k, k_rope] and values latent @ W_v."""
    B, S, H, N, R, C, O = 3, 64, 4, 16, 8, 32, 16
    ks = jax.random.split(jax.random.key(7), 5)
    q_nope, q_rope = jax.random.normal(ks[0], (B, 1, H, N)), jax.random.normal(ks[1], (B, 1, H, R))
    latent, k_rope = jax.random.normal(ks[2], (B, S, C)), jax.random.normal(ks[3], (B, S, R))
    kv_b = jax.random.normal(ks[4], (C, H, N + O)) * C ** -0.5
    pos = jnp.asarray([[5], [40], [63]], jnp.int32)
    hp = jax.lax.Precision.HIGHEST
    k = jnp.concatenate([jnp.einsum("bsc,chn->bshn", latent, kv_b[..., :N], precision=hp),
                         jnp.broadcast_to(k_rope[:, :, None], (B, S, H, R))], -1)
    v = jnp.einsum("bsc,cho->bsho", latent, kv_b[..., N:], precision=hp)
    logits = jnp.einsum("bhp,bshp->bhs", jnp.concatenate([q_nope, q_rope], -1)[:, 0], k, precision=hp) * 0.2
    logits = jnp.where(jnp.arange(S)[None, None] <= pos[:, :, None], logits, -jnp.inf)
    want = jnp.einsum("bhs,bsho->bho", jax.nn.softmax(logits, -1), v, precision=hp)[:, None]
    with record_choices() as rec:
        got = attention_ops.mla_cache_attention({"mla_cache_attention": name}, q_nope, q_rope, latent, k_rope, kv_b,
                                                pos, 0.2, jnp.float32)
    assert rec == {"mla_cache_attention": {name: 1}}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="Mosaic"):
        attention_ops.mla_cache_attention({"mla_cache_attention": "pallas"}, q_nope, q_rope, latent, k_rope, kv_b,
                                          pos, 0.2, jnp.float32)


def test_model_records_the_implementations_it_ran():
    cfg = default_config()
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((2, 16), jnp.int32) + jnp.arange(16)
    with record_choices() as rec:
        jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t)).lower(params, tokens)
    # the kernels, plus the attention path (packed training sequences) and the embedding lookup
    assert set(rec) == {"attention", "experts", "matmul", "norm", "gqa_attention", "embed"}
    assert set(rec["gqa_attention"]) == {"packed"} and set(rec["embed"]) == {"take"}
    cfg.model.kernels.attention, cfg.model.kernels.norm = "xla_dense", "xla"
    with record_choices() as rec:
        jax.jit(lambda p, t: c2jax.models.forward(cfg, p, t)).lower(params, tokens)
    assert set(rec["attention"]) == {"xla_dense"} and set(rec["norm"]) == {"xla"}
