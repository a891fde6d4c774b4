"""Context parallelism (zigzag, MLA latent all-gather, GQA ring / all-gather), expert parallelism
(all-to-all over EP groups built from data x context x expert) and FSDP (embed over fsdp x
context) on 8 fake CPU devices: logits, loss and gradients equal the single-device results."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from c2jax.config import ConfigError, default_config
from c2jax.ops import attention_xla as attention_lib
from c2jax.models import param_shardings
from c2jax.ops import record_choices
from c2jax.parallel import activate, make_mesh
from c2jax.parallel.context import zigzag_order, zigzag_permute, zigzag_unpermute
from c2jax.train.step import token_nll, total_loss

B, L = 4, 32


def _rule(cfg, name, value):
    cfg.mesh.rules = tuple((n, value) if n == name else (n, t) for n, t in cfg.mesh.rules)


def _cfg(attention, shape, cp_impl="allgather", experts=("expert",), expert_embed=None, expert_fsdp=None):
    cfg = default_config()
    cfg.model.attention = attention
    cfg.model.moe_dispatch = "dropless"
    cfg.model.load_balance_loss_weight = 0.01
    cfg.mesh.shape = shape
    cfg.mesh.cp_impl = cp_impl
    _rule(cfg, "embed", ("fsdp", "context"))      # FSDP, with the context axis folded in
    _rule(cfg, "experts", experts)
    _rule(cfg, "expert_embed", expert_embed)      # FSDP of the expert weights (gathered inside the EP shard_map)
    _rule(cfg, "expert_fsdp", expert_fsdp)        # ... on their expert dim
    cfg.train.seq_len = L
    return cfg


def _batch(cfg):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1))
    # packed segments of different lengths per row (positions restart in each segment)
    seg = np.ones((B, L), np.int32)
    pos = np.zeros((B, L), np.int32)
    for b, cut in enumerate([5, 12, 20, 31]):
        seg[b, cut:] = 2
        pos[b] = np.where(seg[b] == 1, np.arange(L), np.arange(L) - cut)
    weights = np.ones((B, L), np.float32)
    weights[:, -3:] = 0.0
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
            "positions": jnp.asarray(pos), "segment_ids": jnp.asarray(seg), "loss_weights": jnp.asarray(weights)}


def _loss_logits_grads(cfg, params, batch):
    """The trainer's loss (c2jax.train.step) and its gradients, plus the logits, in one pass."""
    def f(p):
        out = c2jax.models.forward(cfg, p, batch["inputs"], batch["positions"], batch["segment_ids"],
                                   return_aux=True)
        w = batch["loss_weights"]
        nll, _ = token_nll(out.logits, batch["targets"])
        terms = {"nll_sum": jnp.sum(nll * w), "lb_loss": jnp.mean(out.aux["load_balance_loss"]),
                 "z_router": jnp.mean(out.aux["router_z_loss"])}
        return total_loss(cfg, terms, jnp.sum(w), 1), out.logits
    (loss, logits), grads = jax.value_and_grad(f, has_aux=True)(params)
    return logits, loss, grads


@functools.cache
def _reference(attention):
    cfg = _cfg(attention, (1, 1, 1, 1))
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    one = make_mesh(cfg, jax.devices()[:1])
    with activate(cfg, one):
        out = jax.jit(functools.partial(_loss_logits_grads, cfg))(params, _batch(cfg))
    return params, jax.device_get(out)


def _rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(np.asarray(b))), 1e-30))


CASES = [
    # attention, mesh (data, fsdp, context, expert), GQA CP impl, EP axes
    ("gqa", (2, 1, 2, 2), "ring", ("expert",)),
    ("gqa", (1, 4, 2, 1), "allgather", ("context",)),                    # FSDP 4 x CP 2, EP over the CP ranks
    ("mla", (2, 2, 2, 1), "allgather", ("data", "context")),            # EP 4 from data x context (the report's)
    ("mla", (2, 1, 2, 2), "allgather", ("data", "context", "expert")),  # EP 8 over every device
    # EP 4, expert weights FSDP over fsdp and tokens dispatched in 2 chunks (the pods' layout)
    ("mla", (1, 2, 2, 2), "allgather", ("context", "expert"), "fsdp", 2),
]


# mesh.ep_exchange="ragged" (only the routed rows sent; on CPU the dense form of the same plan), dropless
RAGGED_CASES = [
    ("mla", (2, 1, 2, 2), "allgather", ("data", "context", "expert"), None, 1),   # EP 8, every device
    ("mla", (1, 2, 2, 2), "allgather", ("context", "expert"), "fsdp", 2),       # EP 4, FSDP experts, 2 chunks
]


# expert weights FSDP on their expert dim (mesh rule expert_fsdp): E over the EP group, then fsdp
EXPERT_FSDP_CASES = [
    ("mla", (1, 2, 2, 2), "allgather", ("context", "expert"), None, 1, "capacity", "fsdp"),   # 1 expert a chip
    ("gqa", (2, 2, 1, 2), "allgather", ("expert",), "fsdp", 2, "ragged", ("data", "fsdp")),   # D takes what E leaves
]


@pytest.mark.parametrize("attention,shape,cp_impl,experts,expert_embed,ep_chunks,ep_exchange,expert_fsdp",
                         [c + (None, 1)[len(c) - 4:] + ("capacity", None) for c in CASES]
                         + [c + ("ragged", None) for c in RAGGED_CASES] + EXPERT_FSDP_CASES)
def test_parallel_matches_single_device(attention, shape, cp_impl, experts, expert_embed, ep_chunks, ep_exchange,
                                        expert_fsdp):
    assert jax.device_count() == 8
    params, (ref_logits, ref_loss, ref_grads) = _reference(attention)
    cfg = _cfg(attention, shape, cp_impl, experts, expert_embed, expert_fsdp)
    cfg.mesh.ep_token_chunks = ep_chunks
    cfg.mesh.ep_exchange = ep_exchange
    mesh = make_mesh(cfg)
    cp = mesh.shape["context"]
    batch = zigzag_permute(_batch(cfg), cp)
    with activate(cfg, mesh), record_choices() as ran:
        shardings = param_shardings(cfg, mesh)
        sharded = jax.device_put(params, shardings)
        fn = jax.jit(functools.partial(_loss_logits_grads, cfg))
        logits, loss, grads = fn(sharded, batch)
        text = fn.lower(sharded, batch).as_text()
    assert set(ran["attention"]) == {"xla_blocked"}    # CP ranks' local attention: XLA on CPU
    assert "all_to_all" in text and "ragged_all_to_all" not in text   # XLA:CPU: dense exchanges only
    assert _rel_err(zigzag_unpermute(logits, cp), ref_logits) <= 1e-5
    assert _rel_err(loss, ref_loss) <= 1e-5
    errs = jax.tree.map(_rel_err, grads, ref_grads)
    worst = max(jax.tree.leaves(errs))
    assert worst <= 1e-5, errs
    # FSDP: a dense weight is sharded over fsdp x context, experts over the EP axes (+ expert_fsdp)
    moe = shardings["moe_layers"]["block"]["moe"]
    e_fsdp = (expert_fsdp,) if isinstance(expert_fsdp, str) else tuple(expert_fsdp or ())
    e_axes = tuple(a for a in experts + e_fsdp if mesh.shape[a] > 1)
    d_axes = expert_embed if expert_embed not in e_fsdp else None   # an axis E took is not reused
    assert moe["w_gate"].spec[1] == (e_axes if len(e_axes) > 1 else e_axes[0])       # [layers, E, D, F]
    assert moe["w_gate"].spec[2] == d_axes and moe["w_down"].spec[3] == d_axes
    fsdp_axes = tuple(a for a in ("fsdp", "context") if mesh.shape[a] > 1)
    assert moe["router"].spec[1] == (fsdp_axes if len(fsdp_axes) > 1 else fsdp_axes[0])  # [layers, D, E]


def test_ragged_plan_drops_only_what_overflows_a_receiver():
    """The plan on 8 devices against a numpy model: receivers store senders' rows in rank order
    and keep the first R; each sender's kept counts and every offset follow from that."""
    from jax.sharding import PartitionSpec as P
    from c2jax.ops.ragged import exchange, ragged_plan
    W, R = 8, 12
    rng = np.random.default_rng(5)
    S = rng.integers(0, 5, (W, W)).astype(np.int32)            # S[p, q]: rows p sends to q
    S[:, 3] = 4                                                # receiver 3 gets 32 rows: 20 overflow
    mesh = jax.make_mesh((W,), ("x",))
    M = int(S.sum(1).max())
    rows = np.full((W, M, 2), -1.0, np.float32)
    for p in range(W):                                         # row = (sender, receiver) tags
        q_of = np.repeat(np.arange(W), S[p])
        rows[p, :len(q_of)] = np.stack([np.full(len(q_of), p), q_of], 1)

    def body(sizes, x):
        plan = ragged_plan(sizes[0], R, "x")
        got = exchange(x[0], jnp.full((R, 2), -1.0), plan, "x")           # CPU: the dense form
        back = exchange(got, jnp.full((M, 2), -7.0), plan, "x", back=True)
        return tuple(a[None] for a in (plan.send, plan.recv, got, back))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    put = lambda a: jax.device_put(jnp.asarray(a), jax.sharding.NamedSharding(mesh, P("x")))  # noqa: E731
    send, recv, got, back = (np.asarray(a) for a in f(put(S), put(rows)))
    for q in range(W):
        before = np.cumsum(S[:, q]) - S[:, q]
        kept = np.clip(R - before, 0, S[:, q])
        np.testing.assert_array_equal(recv[q], kept)
        np.testing.assert_array_equal(send[:, q], kept)
        want = np.concatenate([np.tile([p, q], (k, 1)) for p, k in enumerate(kept)] or [np.zeros((0, 2))])
        np.testing.assert_array_equal(got[q, :len(want)], want)
        assert (got[q, len(want):] == -1).all()                # unwritten rows keep the output's value
    for p in range(W):                                         # kept rows come back in place
        start = np.cumsum(S[p]) - S[p]
        for q in range(W):
            seg = back[p, start[q]:start[q] + S[p, q]]
            assert (seg[:send[p, q]] == [p, q]).all() and (seg[send[p, q]:] == -7).all()


def test_token_parallel_experts_gather_fsdp_shards_on_every_dim():
    """The MoE path without EP (what a Mosaic expert kernel runs under FSDP: every chip runs all
    experts on its own tokens, the weights' FSDP shards gathered inside the shard_map): with E
    split over `expert_fsdp` and D over `expert_embed`, output and gradients equal one device's."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from c2jax.ops import experts_xla
    from c2jax.ops import experts_ep as ep
    cfg = _cfg("gqa", (2, 4, 1, 1), expert_embed="data", expert_fsdp="fsdp")
    Bt, Lt, D, F, E, K = 8, 6, 16, 24, 8, 2
    ks = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(ks[0], (Bt, Lt, D), jnp.float32)
    ids = jax.lax.top_k(jax.random.normal(ks[1], (Bt, Lt, E)), K)[1].astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(ks[2], (Bt, Lt, K)), -1)
    ws = [jax.random.normal(k, s, jnp.float32) * 0.2 for k, s in zip(ks[3:], ((E, D, F), (E, D, F), (E, F, D)))]
    cot = jax.random.normal(jax.random.key(4), (Bt, Lt, D), jnp.float32)

    def local(x_TD, ids_TK, wts_TK, wg, wu, wd):
        return experts_xla.grouped_dispatch(x_TD, ids_TK, wts_TK, wg, wu, wd)

    def loss(dispatch, x, wg, wu, wd):
        return jnp.sum(dispatch(x, ids, wts, wg, wu, wd)[0] * cot)

    def single(x, ids, wts, wg, wu, wd):
        y, dropped = local(x.reshape(-1, D), ids.reshape(-1, K), wts.reshape(-1, K), wg, wu, wd)
        return y.reshape(Bt, Lt, D), dropped

    ref = jax.jit(jax.value_and_grad(functools.partial(loss, single), argnums=(0, 1, 2, 3)))(x, *ws)
    mesh = make_mesh(cfg)
    with activate(cfg, mesh):
        ws_sharded = [jax.device_put(w, NamedSharding(mesh, spec)) for w, spec in
                      zip(ws, (P("fsdp", "data", None), P("fsdp", "data", None), P("fsdp", None, "data")))]
        fn = functools.partial(ep.token_parallel_dispatch, local_fn=local)
        got = jax.jit(jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3)))(x, *ws_sharded)
        text = jax.jit(functools.partial(loss, fn)).lower(x, *ws_sharded).as_text()
    assert text.count("all_gather") >= 6        # each weight gathered on E (fsdp) and on D (data)
    assert _rel_err(got[0], ref[0]) <= 1e-5
    for g, r in zip(got[1], ref[1]):
        assert _rel_err(g, r) <= 1e-5


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_context_attention_runs_the_chosen_local_kernel(attention):
    """Under CP each rank attends the gathered keys with the implementation c2jax.ops chose: the
    flash kernel (here by the Pallas interpreter, as on TPU by Mosaic) with the zigzag positions
    and packed segments gives XLA's masked product's values and gradients. (Outside the flax
    model: the interpreter's callbacks inside shard_map are effects nn.scan cannot trace.)"""
    from c2jax.ops import attention as attention_ops
    cfg = _cfg(attention, (1, 4, 2, 1), "allgather", ("context",))
    mesh = make_mesh(cfg)
    batch = zigzag_permute(_batch(cfg), 2)
    pos, seg = batch["positions"], batch["segment_ids"]
    rng = np.random.default_rng(1)
    H, N, R, O, C = 4, 16, 8, 16, 32
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    if attention == "gqa":
        args = (arr(B, L, H, N), arr(B, L, 2, N), arr(B, L, 2, O))
        fn = lambda kn, q, k, v: attention_ops.attention(kn, q, k, v, pos, seg, 0.3)  # noqa: E731
    else:
        args = (arr(B, L, H, N), arr(B, L, H, R), arr(B, L, C), arr(B, L, R), arr(C, H, N + O) / 4)
        fn = lambda kn, *a: attention_ops.mla_context_attention(kn, *a, pos, seg, 0.3, jnp.float32)  # noqa: E731
    out_ct = arr(B, L, H, O)
    results = {}
    for local in ("xla_blocked", "pallas_flash_interpret"):
        loss = lambda *a: jnp.sum(fn({"attention": local}, *a) * out_ct)  # noqa: E731
        with activate(cfg, mesh), record_choices() as ran:
            results[local] = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))(*args)
        assert ran["attention"] == {local: 1}
    (ref, ref_g), (got, got_g) = results["xla_blocked"], results["pallas_flash_interpret"]
    assert _rel_err(got, ref) <= 1e-5
    for g, r in zip(got_g, ref_g):
        assert _rel_err(g, r) <= 1e-4


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_decode_attention_kernels_run_per_row_shard(attention):
    """On a mesh the decode kernels (GQA's, and MLA's in the latent space; here by the Pallas
    interpreter) run inside a shard_map over the rows' batch axes and equal XLA's single-device
    result."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from c2jax.ops import attention as attention_ops
    cfg = _cfg(attention, (2, 2, 1, 2))
    mesh = make_mesh(cfg)
    rng = np.random.default_rng(2)
    Bd, S, H, N, R, O, C = 8, 64, 4, 16, 8, 16, 32
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    pos = jnp.asarray(rng.integers(0, S, (Bd, 1)), jnp.int32)
    if attention == "gqa":
        op, names = "decode_attention", ("xla", "pallas_interpret")
        args = (arr(Bd, 1, H, N), arr(Bd, S, 2, N), arr(Bd, S, 2, O))
        fn = lambda kn, q, k, v: attention_ops.decode_attention(kn, q, k, v, pos, 0.3)  # noqa: E731
    else:
        op, names = "mla_cache_attention", ("xla_absorbed", "pallas_interpret")
        args = (arr(Bd, 1, H, N), arr(Bd, 1, H, R), arr(Bd, S, C), arr(Bd, S, R), arr(C, H, N + O) / 4)
        fn = lambda kn, *a: attention_ops.mla_cache_attention(kn, *a, pos, 0.3, jnp.float32)  # noqa: E731
    want = jax.jit(functools.partial(fn, {op: names[0]}))(*args)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    sharded = [jax.device_put(a, rows) if a.shape[0] == Bd else a for a in args]
    with activate(cfg, mesh), record_choices() as ran:
        got = jax.jit(functools.partial(fn, {op: names[1]}))(*sharded)
    assert ran[op] == {names[1]: 1}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_zigzag_layout():
    order = zigzag_order(16, 2)        # 4 chunks of 4: rank0 = chunks 0,3; rank1 = chunks 1,2
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    x = jnp.arange(32).reshape(2, 16)
    np.testing.assert_array_equal(zigzag_unpermute(zigzag_permute(x, 4), 4), x)
    with pytest.raises(ConfigError, match="2\\*CP"):
        zigzag_order(20, 4)


def _attention_temp_bytes(attention, cp, cp_impl):
    """Per-device temp memory of one attention layer's forward+backward on a context-only mesh."""
    from c2jax.models.attention import GQAAttention, MLAAttention
    cfg = _cfg(attention, (1, 1, cp, 1), cp_impl)
    cfg.model.num_heads, cfg.model.num_kv_heads = 4, 4
    # XLA's block attention, the reference here (the CPU kernel keeps O(L) memory at CP = 1)
    cfg.model.kernels.attention = "xla_blocked"
    Lm = 256
    module = (MLAAttention if attention == "mla" else GQAAttention)(cfg.model)
    x = jnp.zeros((1, Lm, cfg.model.hidden_size))
    pos = jnp.arange(Lm)[None]
    seg = jnp.ones((1, Lm), jnp.int32)
    params = jax.eval_shape(lambda: module.init(jax.random.key(0), x, pos, seg))

    def f(p, x):
        return jnp.sum(module.apply(p, x, pos, seg)[0] ** 2)
    mesh = make_mesh(cfg, jax.devices()[:cp])
    with activate(cfg, mesh):
        xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, "context" if cp > 1 else None)))
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(params, xs).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("attention,cp_impl", [("mla", "allgather"), ("gqa", "ring")])
def test_attention_activation_memory_falls_with_cp(attention, cp_impl, monkeypatch):
    m2, m4 = (_attention_temp_bytes(attention, cp, cp_impl) for cp in (2, 4))
    # CP = 1 runs the causal block attention; with one query block of all L rows it holds the
    # full L x L scores that the CP kernels split into full-row chunks: the point to fall from
    # (its default blocks, keys up to each block only, need less than CP = 2 at this length)
    monkeypatch.setattr(attention_lib, "causal_block_size", lambda L: L)
    m1 = _attention_temp_bytes(attention, 1, cp_impl)
    # roughly 1/CP between CP ranks: allow 30% slack for the gathered latents / K, V blocks and
    # small buffers
    assert m4 <= 0.65 * m2 and m2 < m1, (m1, m2, m4)


def test_bad_mesh_requests_fail_before_compiling():
    cfg = _cfg("gqa", (2, 1, 2, 3))
    with pytest.raises(ConfigError, match="device count 8"):
        make_mesh(cfg)
    cfg = _cfg("gqa", (1, 1, 1, 8))
    cfg.model.num_experts = 12
    cfg.model.num_experts_per_tok = 2
    with pytest.raises(ConfigError, match="num_experts=12"):
        make_mesh(cfg)
    cfg = _cfg("gqa", (2, 1, 4, 1))
    cfg.train.seq_len = 36
    with pytest.raises(ConfigError, match="2\\*CP"):
        make_mesh(cfg)
    cfg = _cfg("gqa", (2, 1, 2, 2), experts=("data", "context", "expert"))
    cfg.model.num_experts = 12
    with pytest.raises(ConfigError, match="expert"):
        make_mesh(cfg)
    cfg = _cfg("gqa", (1, 4, 1, 2), expert_fsdp="fsdp")
    cfg.model.num_experts = 12                           # 6 per EP rank do not split over fsdp 4
    with pytest.raises(ConfigError, match="'expert_fsdp' axes \\('fsdp',\\) of size 4"):
        make_mesh(cfg)
    cfg = _cfg("gqa", (1, 4, 1, 2))
    cfg.mesh.rules = tuple(cfg.mesh.rules) + (("expert_weights", "fsdp"),)
    with pytest.raises(ConfigError, match="may not name 'expert_weights'"):
        make_mesh(cfg)


def _mtp_loss(cfg, params, batch):
    """The trainer's MTP self-distillation term (c2jax.train.step.loss_terms' mtp_sum / mtp_weight)."""
    from c2jax.train.step import loss_terms
    terms = loss_terms(cfg, params, batch)
    return jnp.sum(terms["mtp_sum"]) / jnp.sum(terms["mtp_weight"])


@pytest.mark.parametrize("attention,shape", [("mla", (1, 2, 2, 2)), ("gqa", (2, 1, 2, 2))])
def test_mtp_loss_under_context_parallelism_matches_single_device(attention, shape):
    """MTP heads under CP 2 (zigzag): the shifted tokens and the aligned predictions are gathered
    by position, so the distillation loss and its gradients equal one device's."""
    one, cfg = _cfg(attention, (1, 1, 1, 1)), _cfg(attention, shape)
    one.model.num_mtp_layers = cfg.model.num_mtp_layers = 2
    one.model.head_chunks = cfg.model.head_chunks = 2     # the head applied in strided sequence chunks
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    batch = _batch(cfg)
    with activate(one, make_mesh(one, jax.devices()[:1])):
        ref_loss, ref_grads = jax.device_get(jax.jit(jax.value_and_grad(functools.partial(_mtp_loss, one)))(
            params, batch))
    fn = jax.value_and_grad(functools.partial(_mtp_loss, cfg))
    mesh = make_mesh(cfg)
    assert mesh.shape["context"] == 2
    with activate(cfg, mesh):
        loss, grads = jax.jit(fn)(jax.device_put(params, param_shardings(cfg, mesh)), zigzag_permute(batch, 2))
    assert _rel_err(loss, ref_loss) <= 1e-5, (float(loss), float(ref_loss))
    errs = jax.tree.map(_rel_err, grads, ref_grads)
    assert max(jax.tree.leaves(errs)) <= 1e-5, errs
    assert max(jax.tree.leaves(jax.tree.map(lambda g: float(np.max(np.abs(g))), ref_grads["mtp_1"]))) > 0
