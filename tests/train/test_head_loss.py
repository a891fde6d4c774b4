"""The fused output head + NLL: each token_nll implementation (c2jax.ops.token_nll) against float64
numpy, auto's choice against the unfused path (logits, then token_nll), and the trainer's loss
through it against the logits path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.config import load_config
from c2jax.ops import KernelUnavailable, Target, record_choices
from c2jax.ops.token_nll import HEAD_GRAD, TOKEN_NLL
from c2jax.train.head_loss import head_token_nll
from c2jax.train.step import forward_nll, loss_terms, token_nll


def _inputs(T=24, D=16, V=40, seed=0, tied=False):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V, D) if tied else (D, V)) * 0.3, jnp.float32)
    t = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, T), jnp.float32)    # per-token cotangent weights
    return h, w, t, g


def _reference_f64(h, w, t, g, scale, tied, z=0.1):
    """float64 numpy (nll, lse, dh, dw) of sum(g * (nll + z * lse^2)), logits = scale * h @ W."""
    h64, w64, t, g = (np.asarray(x, np.float64) for x in (h, w, t, g))
    W = w64.T if tied else w64
    logits = scale * h64 @ W
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    t = t.astype(np.int64)
    nll = lse - logits[np.arange(len(t)), t]
    p = np.exp(logits - lse[:, None])
    onehot = np.eye(logits.shape[1])[t]
    d = scale * (g[:, None] * (p - onehot) + (g * 2 * z * lse)[:, None] * p)   # d loss / d (h @ W)
    dh, dW = d @ W.T, h64.T @ d
    return nll, lse, dh, (dW.T if tied else dW)


IMPLS = ["xla", pytest.param("cpu_ffi", marks=pytest.mark.skipif(
    jax.default_backend() != "cpu" or cpu_kernels.unavailable() is not None, reason="CPU kernels unavailable"))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1.0 / 0.7])
def test_fused_head_implementations_match_float64(impl, tied, scale, monkeypatch):
    """Each token_nll implementation, pinned by model.kernels.token_nll: the one chosen is recorded
    and is the one that runs (the FFI calls, or none), and values and gradients match float64 numpy."""
    calls = []
    real = jax.ffi.ffi_call
    monkeypatch.setattr(jax.ffi, "ffi_call", lambda name, *a, **k: calls.append(name) or real(name, *a, **k))
    h, w, t, g = _inputs(V=64, tied=tied, seed=int(tied))
    z = 0.1

    def fused(h, w):
        nll, lse = head_token_nll(h, w, t, scale=scale, tied=tied, kernels={"token_nll": impl})
        return jnp.sum(nll * g) + z * jnp.sum(jnp.square(lse) * g), (nll, lse)

    with record_choices() as rec:
        (_, (nll, lse)), (dh, dw) = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(h, w)
    assert rec["token_nll"] == {impl: 1}, rec
    ffi = [cpu_kernels.TOKEN_NLL_FWD, cpu_kernels.TOKEN_NLL_BWD]
    assert [c for c in calls if c in ffi] == (ffi if impl == "cpu_ffi" else [])
    ref = _reference_f64(h, w, t, g, scale, tied, z)
    for got, want in zip((nll, lse, dh, dw), ref):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert float(jnp.max(jnp.abs(dw))) > 1e-3   # the weight gradient is really there


@pytest.mark.parametrize("V", [40, 64])
@pytest.mark.parametrize("tied", [False, True])
def test_fused_head_matches_logits_then_nll(tied, V):
    """Auto's choice (cpu_ffi on CPU for a vocab that is a multiple of 16, else xla) against the
    unfused path: logits, then token_nll."""
    scale = 1.0 / 0.7
    h, w, t, g = _inputs(V=V, tied=tied, seed=int(tied))

    def ref(h, w):
        logits = (h @ (w.T if tied else w)) * scale
        nll, lse = token_nll(logits, t)
        return jnp.sum(nll * g) + 0.1 * jnp.sum(jnp.square(lse) * g), (nll, lse)

    def fused(h, w):
        nll, lse = head_token_nll(h, w, t, scale=scale, tied=tied)
        return jnp.sum(nll * g) + 0.1 * jnp.sum(jnp.square(lse) * g), (nll, lse)

    (v_r, aux_r), g_r = jax.value_and_grad(ref, argnums=(0, 1), has_aux=True)(h, w)
    with record_choices() as rec:
        (v_f, aux_f), g_f = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(h, w)
    kernel = V % 16 == 0 and jax.default_backend() == "cpu" and cpu_kernels.unavailable() is None
    assert rec["token_nll"] == {"cpu_ffi" if kernel else "xla": 1}
    np.testing.assert_allclose(v_f, v_r, rtol=1e-5)
    for a, b in zip(aux_f + g_f, aux_r + g_r):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_pinned_token_nll_where_it_cannot_run_raises_its_reason():
    h, w, t, _ = _inputs(V=40)
    with pytest.raises(KernelUnavailable, match="token_nll='cpu_ffi'.*multiple of 16"):
        head_token_nll(h, w, t, kernels={"token_nll": "cpu_ffi"})
    with pytest.raises(KernelUnavailable, match="target is tpu"):
        TOKEN_NLL.select("cpu_ffi", Target("tpu"), T=8, V=64)
    assert TOKEN_NLL.select("auto", Target("tpu"), T=8, V=64).name == "xla"
    assert TOKEN_NLL.select("auto", Target("cpu", (("fsdp", 2),)), T=8, V=64).name == "xla"


def test_fused_head_bf16_is_close_to_float32():
    h, w, t, _ = _inputs(T=32, D=32, V=64, seed=3)
    nll32, _ = head_token_nll(h, w, t)
    nll16, _ = head_token_nll(h.astype(jnp.bfloat16), w, t)
    assert nll16.dtype == jnp.float32
    np.testing.assert_allclose(nll16, nll32, atol=0.05)
    dh = jax.grad(lambda h: jnp.sum(head_token_nll(h, w, t)[0]))(h.astype(jnp.bfloat16))
    assert dh.dtype == jnp.bfloat16


@pytest.mark.parametrize("tied", [False, True])
def test_head_grad_choices_match_float64_in_bf16(tied):
    """model.kernels.head_grad: the backward's products in the compute dtype (bf16 here) or in
    float32 both match float64 numpy within bf16's rounding, and only compute_dtype makes a bf16
    copy of the [T, V] gradient. The choice is recorded; auto takes float32 on TPU and the compute
    dtype elsewhere."""
    h, w, t, g = _inputs(T=48, D=32, V=80, seed=5 + int(tied), tied=tied)
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    # the reference sees the bf16-rounded inputs, so only the backward's own rounding differs
    ref = _reference_f64(hb.astype(jnp.float32), wb.astype(jnp.float32), t, g, 1.0, tied, 0.0)
    narrow_grad = {}
    for choice in ("compute_dtype", "float32"):
        def loss(h, w):
            nll, _ = head_token_nll(h, w, t, tied=tied, kernels={"token_nll": "xla", "head_grad": choice})
            return jnp.sum(nll * g)
        grad = jax.grad(loss, argnums=(0, 1))
        with record_choices() as rec:
            dh, dw = jax.jit(grad)(hb, wb)
        assert rec["head_grad"] == {choice: 1}, rec
        assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
        for got, want in ((dh, ref[2]), (dw, ref[3])):
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.03, atol=0.03)
        # what the products read: a bf16 [T, V] copy of the logits gradient, or none
        narrow_grad[choice] = "bf16[48,80]" in str(jax.make_jaxpr(grad)(hb, wb))
    assert narrow_grad == {"compute_dtype": True, "float32": False}, narrow_grad
    assert HEAD_GRAD.select("auto", Target("tpu")).name == "float32"
    assert HEAD_GRAD.select("auto", Target("gpu")).name == "compute_dtype"
    assert HEAD_GRAD.select("auto", Target("cpu")).name == "compute_dtype"


@pytest.mark.parametrize("name,extra", [("tiny.py", ()), ("tiny.py:mla", ()),
                                        ("tiny.py", ("--config.model.tie_embeddings=True",))])
def test_loss_terms_fused_equal_logits_path(name, extra):
    """The trainer's loss through the fused head (its token_nll as model.kernels chooses) against
    the logits path."""
    cfg = load_config(f"configs/{name}", [*extra,
        "--config.model.hidden_size=32", "--config.model.num_layers=2", "--config.model.moe_intermediate_size=16",
        "--config.model.intermediate_size=32", "--config.model.vocab_size=96", "--config.model.init_std=0.1"])
    params = c2jax.models.init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(2)
    B, L = 2, 12
    x = rng.integers(0, 96, (B, L + 1)).astype(np.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": np.ones((B, L), np.int32),
             "positions": np.arange(L, dtype=np.int32)[None].repeat(B, 0),
             "loss_weights": rng.uniform(0.5, 1.0, (B, L)).astype(np.float32)}
    nll_f, lse_f, _ = forward_nll(cfg, params, batch, scale=1.3)
    nll_r, lse_r, _ = forward_nll(cfg, params, batch, scale=1.3, with_logits=True)
    np.testing.assert_allclose(nll_f, nll_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse_f, lse_r, rtol=1e-5, atol=1e-5)

    def loss(p, fused):
        if fused:
            terms = loss_terms(cfg, p, batch)
        else:
            nll, _, _ = forward_nll(cfg, p, batch, with_logits=True)
            terms = {"nll_sum": jnp.sum(nll * batch["loss_weights"])}
        return terms["nll_sum"]
    g_f = jax.grad(loss)(params, True)
    g_r = jax.grad(loss)(params, False)
    # f32 sums in another order on each path: differences of ~1e-6 on entries of ~1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-6), g_f, g_r)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_matches_one_pass(tied):
    from c2jax.train.head_loss import chunked_head_token_nll
    rng = np.random.default_rng(3)
    B, L, D, V = 2, 12, 16, 40
    h = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V, D) if tied else (D, V)) * 0.3, jnp.float32)
    t = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, (B, L)), jnp.float32)

    def loss(h, w, chunks, unroll=False):
        nll, lse = chunked_head_token_nll(h, w, t, chunks=chunks, scale=0.7, tied=tied, unroll=unroll)
        return jnp.sum(g * (nll + 0.1 * lse ** 2)), (nll, lse)

    (ref, (nll1, lse1)), (dh1, dw1) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w, 1)
    for chunks, unroll in ((3, False), (4, False), (4, True), (5, False)):  # 5 does not divide 12: one pass
        (val, (nll, lse)), (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
                                             static_argnums=(2, 3))(h, w, chunks, unroll)
        np.testing.assert_allclose(nll, nll1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, lse1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dh, dh1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, dw1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(val, ref, rtol=1e-5)
    # and the one-pass path against float64
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    logits = 0.7 * (h64 @ (w64.T if tied else w64))
    lse64 = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll64 = lse64 - np.take_along_axis(logits, np.asarray(t)[..., None], -1)[..., 0]
    np.testing.assert_allclose(nll1, nll64, rtol=1e-5, atol=1e-5)


def test_head_chunks_in_the_trainer_loss():
    cfg = load_config("configs/tiny.py")
    cfg2 = load_config("configs/tiny.py", ["--config.model.head_chunks=4"])
    params = c2jax.models.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    B, L = 2, 16
    toks = rng.integers(0, cfg.model.vocab_size, (B, L + 1))
    batch = {"inputs": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32),
             "segment_ids": jnp.ones((B, L), jnp.int32), "positions": jnp.tile(jnp.arange(L), (B, 1)),
             "loss_weights": jnp.ones((B, L), jnp.float32)}
    n1, l1, _ = forward_nll(cfg, params, batch)
    n4, l4, _ = forward_nll(cfg2, params, batch)
    np.testing.assert_allclose(n4, n1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l4, l1, rtol=1e-5, atol=1e-5)
    with pytest.raises(c2jax.config.ConfigError, match="head_chunks"):
        load_config("configs/tiny.py", ["--config.model.head_chunks=0"])


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_mtp_distill_matches_logits_reference(tied):
    """chunked_head_distill (per depth, any chunking) against mtp_distill_loss on materialized
    logits: values, and gradients to the MTP states and the head weight (none to the teacher)."""
    from c2jax.train.head_loss import _logits, chunked_head_distill
    from c2jax.train.step import mtp_distill_loss
    rng = np.random.default_rng(4)
    P, B, L, D, V = 2, 2, 12, 16, 40
    h = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
    mh = jnp.asarray(rng.standard_normal((P, B, L, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V, D) if tied else (D, V)) * 0.3, jnp.float32)
    lw = jnp.asarray(rng.uniform(0.5, 1.5, (B, L)), jnp.float32)
    seg = jnp.asarray(np.repeat([[1] * 7 + [2] * 5], B, 0), jnp.int32)
    mseg = jnp.stack([jnp.where(jnp.arange(L) >= p + 1, jnp.roll(seg, p + 1, axis=1), -1) for p in range(P)])
    wt = lw[None] * (mseg == seg[None])

    def reference(h, mh, w):
        lg = lambda x: _logits(x.reshape(-1, D), w, 1.0, tied).reshape(x.shape[:-1] + (V,))  # noqa: E731
        per = [mtp_distill_loss(lg(mh[p])[None], lg(h), lw, seg, mseg[p][None]) for p in range(P)]
        return jnp.stack([s for s, _ in per]), jnp.stack([x for _, x in per])

    s_ref, w_ref = reference(h, mh, w)
    g_ref = jax.grad(lambda *a: jnp.sum(reference(*a)[0] * jnp.array([1.0, 0.5])), argnums=(0, 1, 2))(h, mh, w)
    assert float(jnp.max(jnp.abs(g_ref[0]))) == 0.0     # the teacher carries no gradient
    for chunks, unroll in ((1, False), (3, False), (4, True), (5, False)):
        fn = lambda h, mh, w: chunked_head_distill(h, mh, w, wt, chunks=chunks, tied=tied, unroll=unroll)  # noqa
        s, ww = jax.jit(fn)(h, mh, w)
        np.testing.assert_allclose(s, s_ref, rtol=1e-5)
        np.testing.assert_allclose(ww, w_ref, rtol=1e-6)
        g = jax.grad(lambda *a: jnp.sum(fn(*a)[0] * jnp.array([1.0, 0.5])), argnums=(0, 1, 2))(h, mh, w)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("head_chunks", [1, 4])
def test_trainer_mtp_terms_equal_logits_path(head_chunks):
    """loss_terms' per-depth MTP terms (heads' states through the chunked head) against
    mtp_distill_loss on the model's aux mtp_logits, with gradients."""
    from c2jax.train.step import mtp_distill_loss
    cfg = load_config("configs/tiny.py", [
        "--config.model.hidden_size=32", "--config.model.num_layers=2", "--config.model.moe_intermediate_size=16",
        "--config.model.intermediate_size=32", "--config.model.vocab_size=96", "--config.model.init_std=0.1",
        "--config.model.num_mtp_layers=2", f"--config.model.head_chunks={head_chunks}"])
    params = c2jax.models.init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(5)
    B, L = 2, 16
    x = rng.integers(0, 96, (B, L + 1)).astype(np.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": np.repeat([[1] * 9 + [2] * 7], B, 0),
             "positions": np.arange(L, dtype=np.int32)[None].repeat(B, 0),
             "loss_weights": rng.uniform(0.5, 1.0, (B, L)).astype(np.float32)}

    def fused(p):
        t = loss_terms(cfg, p, batch)
        return jnp.sum(t["mtp_sum"]) / jnp.sum(t["mtp_weight"]), t

    def reference(p):
        _, _, out = forward_nll(cfg, p, batch, with_logits=True)
        per = [mtp_distill_loss(out.aux["mtp_logits"][d][None], out.logits, batch["loss_weights"],
                                batch["segment_ids"], out.aux["mtp_segment_ids"][d][None]) for d in range(2)]
        s, w = jnp.stack([a for a, _ in per]), jnp.stack([b for _, b in per])
        return jnp.sum(s) / jnp.sum(w), {"mtp_sum": s, "mtp_weight": w}

    (v_f, t_f), g_f = jax.value_and_grad(fused, has_aux=True)(params)
    (v_r, t_r), g_r = jax.value_and_grad(reference, has_aux=True)(params)
    assert t_f["mtp_sum"].shape == (2,)
    np.testing.assert_allclose(t_f["mtp_sum"], t_r["mtp_sum"], rtol=1e-5)
    np.testing.assert_allclose(t_f["mtp_weight"], t_r["mtp_weight"], rtol=1e-6)
    np.testing.assert_allclose(v_f, v_r, rtol=1e-5)
    assert float(jnp.max(jnp.abs(g_f["mtp_1"]["eh_proj"]["kernel"]))) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-6), g_f, g_r)
