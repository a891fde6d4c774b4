"""Model properties that must hold for any weights: causality, packed-segment isolation, dispatch
agreement, selection bias vs combine weights, router replay, the bias update, MTP offsets,
remat-invariant gradients, and preset parameter counts.

Every test uses tiny shapes, fresh random inputs and a non-trivial init (init_std 0.15) so
logits are not flat and routing differs across tokens; each asserts the property's negation
is observable too (e.g. later logits DO change), so a broken property cannot pass vacuously.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import c2jax
from small_models import small_model_cfg
from c2jax.config import load_config
from c2jax.models import moe as moe_lib
from c2jax.ops import experts_xla
from c2jax.train.step import train_flops_per_token

ATTENTIONS = ["gqa", "mla"]
B, L = 2, 10  # every jitted model call uses this shape, so each function compiles once
_MEMO = {}


def _memo(key, make):
    if key not in _MEMO:
        _MEMO[key] = make()
    return _MEMO[key]


def small_cfg(attention, **overrides):
    """configs/tiny.py shrunk further: 2 layers, 8 experts top-2, dropless (grouped) dispatch.
    MLA keeps the preset's sigmoid router + selection bias, shared expert and group-limited routing."""
    # GQA: 2 MoE layers; MLA: 1 dense + 1 MoE layer (both layouts, two scanned stacks).
    make = lambda: small_model_cfg(attention, **overrides)  # noqa: E731
    return _memo(("cfg", attention, tuple(sorted(overrides.items()))), make)


def make_params(cfg, seed=0):
    """Fresh random params of the model's exact structure (from `abstract_params`), filled on the
    host: normal(init_std) weights, norm scales near 1, a small random router bias (zeros at init,
    so the selection-bias path is exercised everywhere). Filling on the host avoids compiling
    init_params (threefry init compiles for ~20 s on a loaded 2-core CPU)."""
    m = cfg.model

    def make():
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

        return jax.tree_util.tree_map_with_path(fill, c2jax.models.abstract_params(cfg))
    return _memo(("params", m.attention, m.num_mtp_layers, m.num_experts, seed), make)


def rand_tokens(cfg, key, shape=(B, L)):
    return jax.random.randint(jax.random.key(key), shape, 0, cfg.model.vocab_size, dtype=jnp.int32)


def default_pos_seg():
    return jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)), jnp.ones((B, L), jnp.int32)


def router_of(params):
    return params["moe_layers"]["block"]["moe"]["router"]


def model_fn(cfg):
    """Jitted (params, tokens, positions, segment_ids, forced) -> (logits, aux), one per config."""
    def f(params, tokens, positions, segments, forced):
        out = c2jax.models.forward(cfg, params, tokens, positions, segments, forced_expert_ids=forced,
                                   return_aux=True)
        return out.logits, out.aux
    return _memo(("fwd", id(cfg)), lambda: jax.jit(f))


def run(cfg, params, tokens, positions=None, segments=None, forced=None):
    pos, seg = default_pos_seg()
    return model_fn(cfg)(params, tokens, pos if positions is None else positions,
                         seg if segments is None else segments, forced)


def full_loss(cfg, params, tokens, targets, forced=None):
    """Token NLL + aux losses + MTP NLL (the terms a training loss is built from)."""
    out = c2jax.models.forward(cfg, params, tokens, forced_expert_ids=forced, return_aux=True)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    loss = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    loss = loss + 0.01 * jnp.sum(out.aux["load_balance_loss"]) + 1e-3 * jnp.sum(out.aux["router_z_loss"])
    if "mtp_logits" in out.aux:
        mlogp = jax.nn.log_softmax(out.aux["mtp_logits"], axis=-1)
        loss = loss - 0.3 * jnp.mean(jnp.take_along_axis(mlogp, targets[None, ..., None], axis=-1))
    return loss, (out.logits, out.aux["expert_ids"])


def grad_fn(cfg):
    """Jitted (params, tokens, targets, forced) -> ((loss, (logits, expert_ids)), grads), one per
    config. Tests call it with forced ids (the model's own ids where routing should be free, which
    reproduces the free forward exactly: see test_forced_expert_ids) so one compile serves all."""
    return _memo(("grad", id(cfg)), lambda: jax.jit(jax.value_and_grad(
        lambda p, t, y, f: full_loss(cfg, p, t, y, f), has_aux=True)))


def assert_trees_close(a, b, atol, rtol=0.0):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol),
                 a, b)


# ----------------------------------------------------------------------------- 1. causality


def _different_tokens(cfg, tokens, key):
    """Tokens that differ from `tokens` at every position."""
    V = cfg.model.vocab_size
    return (tokens + 1 + rand_tokens(cfg, key, tokens.shape) % (V - 1)) % V


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("dispatch", ["grouped", "capacity"])
def test_causality(attention, dispatch):
    # capacity_factor = num_experts: nothing can be dropped, so capacity dispatch stays per-token.
    # (With drops, capacity dispatch legitimately couples tokens: later tokens can take slots.)
    cfg = small_cfg(attention) if dispatch == "grouped" else small_cfg(attention, moe_dispatch="capacity",
                                                                        capacity_factor=8.0)
    params = make_params(cfg)
    t = 6
    tokens = rand_tokens(cfg, 1)
    changed = tokens.at[:, t:].set(_different_tokens(cfg, tokens, 2)[:, t:])
    a_logits, a_aux = run(cfg, params, tokens)
    b_logits, b_aux = run(cfg, params, changed)
    np.testing.assert_allclose(np.asarray(a_logits[:, :t]), np.asarray(b_logits[:, :t]), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(a_aux["expert_ids"][:, :, :t]),
                                  np.asarray(b_aux["expert_ids"][:, :, :t]))
    assert float(jnp.max(jnp.abs(a_logits[:, t:] - b_logits[:, t:]))) > 1e-3  # non-vacuous
    assert float(jnp.max(a_aux["dropped_fraction"])) == 0.0


# ----------------------------------------------------------------------------- 2. packed segments


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_packed_segments_are_isolated(attention):
    cfg = small_cfg(attention)
    params = make_params(cfg)
    la, lb = 4, 6  # la + lb == L
    doc_a, doc_b = rand_tokens(cfg, 3, (1, la)), rand_tokens(cfg, 4, (1, lb))
    filler = rand_tokens(cfg, 5, (1, L))
    # Row 0 packs [A | B] (segments 1, 2; positions restart). Row 1 holds B alone at the row start
    # (filler after it cannot reach back: causality is tested above).
    tokens = jnp.concatenate([jnp.concatenate([doc_a, doc_b], 1),
                              jnp.concatenate([doc_b, filler[:, :la]], 1)])
    positions = jnp.array([list(range(la)) + list(range(lb)), list(range(L))], jnp.int32)
    segments = jnp.array([[1] * la + [2] * lb, [1] * lb + [2] * la], jnp.int32)
    packed, _ = run(cfg, params, tokens, positions, segments)
    # A alone: A at the start of a row followed by filler in another segment.
    tokens_a = jnp.concatenate([jnp.concatenate([doc_a, filler[:, :lb]], 1), filler])
    alone_a, _ = run(cfg, params, tokens_a)
    np.testing.assert_allclose(np.asarray(packed[0, :la]), np.asarray(alone_a[0, :la]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(packed[0, la:]), np.asarray(packed[1, :lb]), atol=1e-5, rtol=0)
    # Non-vacuous: as one document (no segment ids, positions continuing) B's logits differ.
    joined, _ = run(cfg, params, tokens)
    assert float(jnp.max(jnp.abs(joined[0, la:] - packed[1, :lb]))) > 1e-3


# ----------------------------------------------------------------------------- 3. dispatch paths


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_dispatch_paths_and_remat_agree(attention):
    """Grouped (dropless) and capacity dispatch with capacity_factor = num_experts agree on logits,
    routing and gradients; the capacity gradient is taken with remat="full", so the same comparison
    also checks that rematerialization leaves gradients unchanged (8.), at one compile less per
    attention type (compiles dominate this file's runtime on a shared 2-core CPU)."""
    grouped = small_cfg(attention)  # remat="none"
    capacity = small_cfg(attention, moe_dispatch="capacity", capacity_factor=8.0)  # = num_experts
    capacity_remat = small_cfg(attention, moe_dispatch="capacity", capacity_factor=8.0, remat="full")
    params = make_params(grouped)
    tokens, targets = rand_tokens(grouped, 6), rand_tokens(grouped, 7)
    a_logits, a_aux = run(grouped, params, tokens)
    b_logits, b_aux = run(capacity, params, tokens)
    np.testing.assert_allclose(np.asarray(a_logits), np.asarray(b_logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(a_aux["expert_ids"]), np.asarray(b_aux["expert_ids"]))
    assert float(jnp.max(b_aux["dropped_fraction"])) == 0.0
    ids = a_aux["expert_ids"]
    (la, (ga_logits, _)), ga = grad_fn(grouped)(params, tokens, targets, ids)
    (lb, (gb_logits, _)), gb = grad_fn(capacity_remat)(params, tokens, targets, ids)
    # a different compiled program (value_and_grad vs forward) may fuse the per-block softmax of
    # the causal block attention differently: a few float32 ulps after the layers
    np.testing.assert_allclose(np.asarray(ga_logits), np.asarray(a_logits), atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(gb_logits), np.asarray(a_logits), atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(la), float(lb), atol=1e-6)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((ga, gb)))
    assert_trees_close(ga, gb, atol=1e-5)
    g_router = router_of(ga)
    assert bool(jnp.all(jnp.max(jnp.abs(g_router), axis=(1, 2)) > 0))  # routing weights get gradient
    assert float(jnp.max(jnp.abs(ga["embed"]))) > 0


def test_tiny_capacity_drops_and_changes_output(monkeypatch):
    """On one MoE layer: capacity_factor 0.1 drops assignments (dropped_fraction > 0) and the
    output differs from the dropless path; with capacity_factor = num_experts nothing drops.
    (Small token counts are dropless by design; lower that floor so this small T can drop.)"""
    monkeypatch.setattr(experts_xla, "MIN_DROPLESS_CAPACITY", 1)
    outs = {}
    for name, kw in {"grouped": {}, "ample": {"moe_dispatch": "capacity", "capacity_factor": 8.0},
                     "tiny": {"moe_dispatch": "capacity", "capacity_factor": 0.1}}.items():
        cfg = small_cfg("mla", **kw)
        p = jax.tree.map(lambda a: a[0], make_params(cfg)["moe_layers"]["block"]["moe"])
        x = jax.random.normal(jax.random.key(30), (B, L, cfg.model.hidden_size))
        outs[name] = jax.jit(lambda p, x, m=cfg.model: moe_lib.MoE(m).apply({"params": p}, x))(p, x)
    (yg, _), (ya, aa), (yt, at) = outs["grouped"], outs["ample"], outs["tiny"]
    assert float(aa["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(np.asarray(ya), np.asarray(yg), atol=1e-5, rtol=0)
    assert float(at["dropped_fraction"]) > 0
    assert float(jnp.max(jnp.abs(yt - yg))) > 1e-4


# ----------------------------------------------------------------------------- 4. selection bias


def _sigmoid_model_cfg(n_group=1, topk_group=1, k=3):
    cfg = small_cfg("mla", num_experts=8, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                    routed_scaling_factor=2.5, norm_topk_prob=True)
    return cfg.model


def _np_select(logits, bias, m):
    """numpy reference: choose by sigmoid + bias (group-limited), weight by the unbiased sigmoid."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias
    T, E = choice.shape
    if m.n_group > 1:
        g = choice.reshape(T, m.n_group, E // m.n_group)
        gscore = np.sort(g, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-gscore, axis=-1, kind="stable")[:, :m.topk_group]
        mask = np.zeros((T, m.n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, E // m.n_group, axis=1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :m.num_experts_per_tok]
    w = np.take_along_axis(scores, ids, axis=-1)
    w = w / w.sum(-1, keepdims=True) * m.routed_scaling_factor
    return ids, w


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (2, 1)])
def test_selection_bias_changes_choice_not_weights(n_group, topk_group):
    m = _sigmoid_model_cfg(n_group, topk_group)
    T, E = 32, 8
    logits = 2.0 * jax.random.normal(jax.random.key(7), (T, E))
    bias = 3.0 * jax.random.normal(jax.random.key(8), (E,))
    ids0, _, _, _ = moe_lib.select_experts(logits, jnp.zeros(E), m)
    ids, w, _, _ = moe_lib.select_experts(logits, bias, m)
    assert not np.array_equal(np.sort(np.asarray(ids0), -1), np.sort(np.asarray(ids), -1))
    ref_ids, ref_w = _np_select(np.asarray(logits), np.asarray(bias), m)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-6)
    # The weights are exactly the unbiased sigmoid scores of the chosen ids, normalized, scaled.
    s = jax.nn.sigmoid(logits)
    manual = jnp.take_along_axis(s, ids, -1)
    manual = manual / manual.sum(-1, keepdims=True) * 2.5
    np.testing.assert_allclose(np.asarray(w), np.asarray(manual), rtol=1e-6)
    # The bias gets no gradient through the weights (it only selects).
    gb = jax.grad(lambda b: jnp.sum(moe_lib.select_experts(logits, b, m)[1] ** 2))(bias)
    assert float(jnp.max(jnp.abs(gb))) == 0.0


def test_moe_layer_matches_hand_reference_with_bias():
    """End to end on one MoE layer (router param + layer input -> output), with a large bias."""
    cfg = small_cfg("mla")
    m = cfg.model
    params = make_params(cfg)
    p = jax.tree.map(lambda a: a[0], params["moe_layers"]["block"]["moe"])
    bias = 3.0 * jax.random.normal(jax.random.key(9), p["router_bias"].shape)
    x = jax.random.normal(jax.random.key(10), (2, 6, m.hidden_size))
    apply = jax.jit(lambda b: moe_lib.MoE(m).apply({"params": {**p, "router_bias": b}}, x))
    y, aux = apply(bias)
    y0, aux0 = apply(jnp.zeros_like(bias))
    assert not np.array_equal(np.asarray(aux["expert_ids"]), np.asarray(aux0["expert_ids"]))
    assert float(jnp.max(jnp.abs(y - y0))) > 1e-4

    xt = np.asarray(x, np.float64).reshape(-1, m.hidden_size)
    ids, w = _np_select(xt @ np.asarray(p["router"], np.float64), np.asarray(bias, np.float64), m)
    np.testing.assert_array_equal(np.asarray(aux["expert_ids"]).reshape(ids.shape), ids)

    def swiglu(v, g, u, d):
        h = v @ g
        return ((h / (1 + np.exp(-h))) * (v @ u)) @ d

    wg, wu, wd = (np.asarray(p[k], np.float64) for k in ("w_gate", "w_up", "w_down"))
    ref = np.zeros_like(xt)
    for t in range(xt.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            ref[t] += w[t, j] * swiglu(xt[t], wg[e], wu[e], wd[e])
    sh = {k: np.asarray(p["shared"][k]["kernel"], np.float64) for k in ("gate", "up", "down")}
    ref += swiglu(xt, sh["gate"], sh["up"], sh["down"])
    np.testing.assert_allclose(np.asarray(y).reshape(ref.shape), ref, atol=1e-5, rtol=1e-4)


def test_router_bias_changes_model_output():
    cfg = small_cfg("mla")
    params = make_params(cfg)
    tokens = rand_tokens(cfg, 11)
    a_logits, a_aux = run(cfg, params, tokens)
    moe = params["moe_layers"]["block"]["moe"]
    biased = {**params, "moe_layers": {"block": {**params["moe_layers"]["block"], "moe": {
        **moe, "router_bias": 3.0 * jax.random.normal(jax.random.key(12), moe["router_bias"].shape)}}}}
    b_logits, b_aux = run(cfg, biased, tokens)
    assert not np.array_equal(np.asarray(a_aux["expert_ids"]), np.asarray(b_aux["expert_ids"]))
    assert float(jnp.max(jnp.abs(a_logits - b_logits))) > 1e-3


# ----------------------------------------------------------------------------- 5. router replay


def _random_distinct_ids(key, shape_prefix, num_experts, k):
    u = jax.random.uniform(jax.random.key(key), (*shape_prefix, num_experts))
    return jnp.argsort(u, axis=-1)[..., :k].astype(jnp.int32)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_forced_expert_ids(attention):
    cfg = small_cfg(attention)
    m = cfg.model
    params = make_params(cfg)
    tokens, targets = rand_tokens(cfg, 13), rand_tokens(cfg, 14)
    n_moe = c2jax.models.layer_counts(m)[1]
    forced = _random_distinct_ids(15, (n_moe, B, L), m.num_experts, m.num_experts_per_tok)
    (loss, (logits, ids)), grads = grad_fn(cfg)(params, tokens, targets, forced)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(forced))
    g = router_of(grads)
    assert bool(jnp.isfinite(loss)) and bool(jnp.all(jnp.isfinite(g)))
    # Every MoE layer's router gets gradient through the forced experts' combine weights.
    assert bool(jnp.all(jnp.max(jnp.abs(g), axis=(1, 2)) > 0))

    free_logits, free_aux = run(cfg, params, tokens)
    assert float(jnp.max(free_aux["replaced_fraction"])) == 0.0
    assert not np.array_equal(np.asarray(free_aux["expert_ids"]), np.asarray(forced))
    assert float(jnp.max(jnp.abs(free_logits - logits))) > 1e-4
    (_, (own_logits, own_ids)), _ = grad_fn(cfg)(params, tokens, targets, free_aux["expert_ids"])
    np.testing.assert_array_equal(np.asarray(own_ids), np.asarray(free_aux["expert_ids"]))
    # same experts, same logits up to float32 summation order (the grad trace fuses differently;
    # 1.3e-6 seen on logits ~1.7 under load); other experts moved them by > 1e-4 above
    np.testing.assert_allclose(np.asarray(own_logits), np.asarray(free_logits), atol=1e-5, rtol=0)


def _np_replay(forced, choice, k, thr):
    """numpy reference of replay replacement: forced ids scoring < thr * own k-th score are replaced,
    in slot order, by the router's own picks (best first) not among the kept forced ids."""
    own = np.argsort(-choice, kind="stable")[:k]
    kth = choice[own[-1]]
    bad = ~(choice[forced] >= thr * kth)
    kept = set(forced[~bad].tolist())
    pool = [e for e in own if e not in kept]
    out = forced.copy()
    out[bad] = pool[:int(bad.sum())]
    return out, bad


def test_replay_threshold_replaces_implausible_forced_ids():
    cfg = small_cfg("gqa", num_experts=8, num_experts_per_tok=3, replay_threshold=0.1)
    m = cfg.model
    T, E, K = 6, 8, 3
    logits = np.array(jax.random.normal(jax.random.key(16), (T, E)))
    own = np.argsort(-logits, axis=-1)[:, :K]
    forced = np.array(_random_distinct_ids(17, (T,), E, K))
    # Token 0: forced = [own best, a tiny-score expert, own 3rd] -> slot 1 must get own 2nd best.
    tiny_e = next(e for e in range(E) if e not in own[0])
    logits[0, tiny_e] = -30.0
    forced[0] = [own[0, 0], tiny_e, own[0, 2]]
    # Token 1: two implausible forced experts, and one kept forced that is the router's own best.
    bad1 = [e for e in range(E) if e not in own[1]][:2]
    logits[1, bad1] = -30.0
    forced[1] = [bad1[0], own[1, 0], bad1[1]]
    ids, w, _, replaced = moe_lib.select_experts(jnp.asarray(logits), None, m, jnp.asarray(forced))
    ids, replaced = np.asarray(ids), np.asarray(replaced)
    np.testing.assert_array_equal(ids[0], [own[0, 0], own[0, 1], own[0, 2]])
    np.testing.assert_array_equal(replaced[0], [False, True, False])
    np.testing.assert_array_equal(ids[1], [own[1, 1], own[1, 0], own[1, 2]])
    np.testing.assert_array_equal(replaced[1], [True, False, True])
    scores = np.asarray(jax.nn.softmax(jnp.asarray(logits), -1))
    for t in range(T):
        assert len(set(ids[t].tolist())) == K, ids[t]  # no duplicates
        ref_ids, ref_bad = _np_replay(forced[t], scores[t], K, 0.1)
        np.testing.assert_array_equal(ids[t], ref_ids)
        np.testing.assert_array_equal(replaced[t], ref_bad)
    # Weights follow the final ids' scores.
    ref_w = np.take_along_axis(scores, ids, -1)
    np.testing.assert_allclose(np.asarray(w), ref_w / ref_w.sum(-1, keepdims=True), rtol=1e-5)
    # Threshold 0 never replaces.
    m0 = small_cfg("gqa", num_experts=8, num_experts_per_tok=3).model
    ids0, _, _, rep0 = moe_lib.select_experts(jnp.asarray(logits), None, m0, jnp.asarray(forced))
    np.testing.assert_array_equal(np.asarray(ids0), forced)
    assert not bool(jnp.any(rep0))


def test_replay_threshold_random_cases():
    """Many random (logits, forced) pairs against the numpy reference, sigmoid router with bias."""
    m = small_cfg("mla", num_experts=8, num_experts_per_tok=4, n_group=1, topk_group=1,
                  replay_threshold=0.8).model
    T, E, K = 64, 8, 4
    logits = 3.0 * jax.random.normal(jax.random.key(18), (T, E))
    bias = 0.3 * jax.random.uniform(jax.random.key(19), (E,))
    forced = _random_distinct_ids(20, (T,), E, K)
    ids, _, _, replaced = moe_lib.select_experts(logits, bias, m, forced)
    choice = np.asarray(jax.nn.sigmoid(logits) + bias)
    ids, replaced = np.asarray(ids), np.asarray(replaced)
    assert 0 < replaced.sum() < replaced.size
    for t in range(T):
        ref_ids, ref_bad = _np_replay(np.asarray(forced[t]), choice[t], K, 0.8)
        np.testing.assert_array_equal(ids[t], ref_ids)
        np.testing.assert_array_equal(replaced[t], ref_bad)
        assert len(set(ids[t].tolist())) == K


# ----------------------------------------------------------------------------- 6. bias update


def test_update_router_bias_direction():
    load = jnp.array([10.0, 0.0, 5.0, 5.0, 1.0, 9.0])  # mean 5
    bias = jax.random.normal(jax.random.key(21), (6,))
    new = c2jax.models.update_router_bias(bias, load, 0.01)
    delta = np.asarray(new - bias)
    np.testing.assert_allclose(delta, [-0.01, 0.01, 0.0, 0.0, 0.01, -0.01], atol=1e-7)
    # Repeated updates shift selection towards the under-loaded expert.
    m = small_cfg("mla", n_group=1, topk_group=1, num_experts_per_tok=2).model
    logits = jax.random.normal(jax.random.key(22), (64, 8))
    b = jnp.zeros(8)
    load0 = jnp.bincount(moe_lib.select_experts(logits, b, m)[0].reshape(-1), length=8)
    for _ in range(30):
        load_now = jnp.bincount(moe_lib.select_experts(logits, b, m)[0].reshape(-1), length=8)
        b = c2jax.models.update_router_bias(b, load_now, 0.02)
    load1 = jnp.bincount(moe_lib.select_experts(logits, b, m)[0].reshape(-1), length=8)
    assert float(jnp.std(load1.astype(jnp.float32))) < float(jnp.std(load0.astype(jnp.float32)))


# ----------------------------------------------------------------------------- 7. MTP


def test_mtp_depends_on_token_ahead():
    cfg = small_cfg("gqa", num_mtp_layers=2)
    params = make_params(cfg)
    t = 4
    tokens = rand_tokens(cfg, 23)
    other = _different_tokens(cfg, tokens, 24)
    base_logits, base = run(cfg, params, tokens)
    assert base["mtp_logits"].shape == (2, B, L, cfg.model.vocab_size)

    def maxdiff(x, y):
        return float(jnp.max(jnp.abs(x - y)))

    # mtp_logits[d - 1] at index i is the depth-d prediction made at i - d (aligned with the main head)
    d1_logits, d1 = run(cfg, params, tokens.at[:, t + 1].set(other[:, t + 1]))  # token t+1 changed
    assert maxdiff(d1_logits[:, :t + 1], base_logits[:, :t + 1]) < 1e-6         # main logits at <= t: no
    assert maxdiff(d1["mtp_logits"][0, :, :t + 1], base["mtp_logits"][0, :, :t + 1]) < 1e-6
    assert maxdiff(d1["mtp_logits"][0, :, t + 1], base["mtp_logits"][0, :, t + 1]) > 1e-3  # depth 1 made at t: yes
    d2_logits, d2 = run(cfg, params, tokens.at[:, t + 2].set(other[:, t + 2]))  # token t+2 changed
    assert maxdiff(d2_logits[:, :t + 2], base_logits[:, :t + 2]) < 1e-6
    assert maxdiff(d2["mtp_logits"][0, :, :t + 2], base["mtp_logits"][0, :, :t + 2]) < 1e-6
    assert maxdiff(d2["mtp_logits"][1, :, :t + 2], base["mtp_logits"][1, :, :t + 2]) < 1e-6
    assert maxdiff(d2["mtp_logits"][1, :, t + 2], base["mtp_logits"][1, :, t + 2]) > 1e-3  # depth 2 made at t: yes
    np.testing.assert_array_equal(np.asarray(base["mtp_segment_ids"][1, :, :2]), -1)   # nothing made before 0


# 8. remat: see test_dispatch_paths_and_remat_agree.


# ----------------------------------------------------------------------------- 9. param counts


def test_param_counts_of_presets_are_abstract():
    kimi = c2jax.models.param_count(load_config("configs/kimi_k2_1t.py"))
    assert 1.0e12 <= kimi["total"] <= 1.1e12, kimi
    assert 30e9 <= kimi["active"] <= 35e9, kimi
    qwen = c2jax.models.param_count(load_config("configs/qwen3_moe_30b_a3b.py"))
    assert abs(qwen["total"] - 30.5e9) < 0.3e9, qwen
    assert abs(qwen["active"] - 3.3e9) < 0.15e9, qwen
    ds = c2jax.models.param_count(load_config("configs/deepseek_v3_671b.py"))
    assert 6.7e11 <= ds["total"] <= 6.9e11 and 36e9 <= ds["active"] <= 40e9, ds  # 671B + 14B MTP


def test_param_count_matches_hand_count_and_flops():
    cfg = small_cfg("gqa", num_mtp_layers=1)
    m = cfg.model
    D, V, H, G, P, F, Fe, E, K = (m.hidden_size, m.vocab_size, m.num_heads, m.num_kv_heads, m.head_dim,
                                  m.intermediate_size, m.moe_intermediate_size, m.num_experts,
                                  m.num_experts_per_tok)
    attn = D * H * P + 2 * D * G * P + H * P * D + 2 * P + 2 * D  # q, k, v, o, q/k norms, 2 layer norms
    moe_layer = attn + D * E + 3 * E * D * Fe
    mtp = 3 * D + 2 * D * D + moe_layer  # hnorm, enorm, output norm, eh_proj, one MoE block
    cfg_dense = small_cfg("gqa", num_mtp_layers=1, first_k_dense=1)
    total = V * D + D * V + D + 2 * moe_layer + mtp
    assert c2jax.models.param_count(cfg_dense)["total"] == total - moe_layer + attn + 3 * D * F
    counts = c2jax.models.param_count(cfg)
    assert counts["total"] == total
    assert counts["total"] - counts["active"] == 3 * (E - K) * 3 * D * Fe  # 2 MoE layers + 1 MTP block
    assert counts["embedding"] == V * D
    assert counts["mtp"] == mtp and counts["mtp_active"] == mtp - (E - K) * 3 * D * Fe
    L = 128
    attn_flops = 2 * H * (2 * P) * L / 2                       # one layer's causal scores + values
    trunk = counts["active"] - counts["mtp_active"]            # untied: the head's D x V is in there
    f_inf = c2jax.models.flops_per_token(cfg, L, training=False)
    assert f_inf == pytest.approx(2 * (trunk - V * D) + 2 * attn_flops)    # the MTP block does not run
    f_train = c2jax.models.flops_per_token(cfg, L, mtp=True)  # + the MTP block, its attention, its head product
    assert f_train == pytest.approx(3 * (2 * (trunk - V * D + counts["mtp_active"] + D * V) + 3 * attn_flops))
    assert c2jax.models.flops_per_token(cfg, L) == pytest.approx(3 * f_inf)
    # a training step counts the head only where it distils it (train.mtp_loss_weight > 0)
    cfg.train.mtp_loss_weight = 0.3
    assert train_flops_per_token(cfg, L) == pytest.approx(f_train)
    cfg.train.mtp_loss_weight = 0.0
    assert train_flops_per_token(cfg, L) == pytest.approx(3 * f_inf)
