"""The optimizer op (c2jax.ops.optimizer, train.optimizer): the fused CPU AdamW (cpu_fused_adamw,
c2jax.backends.cpu.adamw) against optax_adamw, leaf by leaf, its in-place fast path in the train step,
and the choice itself."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from c2jax.backends.cpu import adamw as cpu_adamw
from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.config import ConfigError, load_config
from c2jax.ops import KernelUnavailable, Target, record_choices
from c2jax.train.optimizer import FusedAdamW, adamw_of, make_optimizer
from c2jax.train.step import apply_if_finite

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason="CPU kernels unavailable")


def _train_cfg(**kw):
    t = dict(grad_clip=1.0, lr=3e-3, b1=0.9, b2=0.95, adam_eps=1e-8, weight_decay=0.1, warmup_steps=2, steps=10,
             min_lr_ratio=0.1)
    t.update(kw)
    return ConfigDict(t)


def _params(rng):
    """Every kind of leaf: decayed matrices (one not a multiple of 16 long), undecayed embedding /
    norm scale, and the frozen router bias."""
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return {"embed": f(37, 8), "final_norm": {"scale": f(8)},
            "moe_layers": {"attn": {"kernel": f(3, 8, 24)}, "moe": {"w_up": f(3, 4, 8, 16), "router": f(3, 8, 4),
                                                                "router_bias": f(3, 4)}}}


def _grads(rng, params, scale):
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * scale, jnp.float32), params)


def _setup(seed):
    """(train config, fused optimizer, params, fresh state, grads) of a random problem."""
    rng = np.random.default_rng(seed)
    t = _train_cfg()
    params = _params(rng)
    opt = make_optimizer(t, params=params)
    assert isinstance(opt, FusedAdamW) and opt.impl == "cpu_fused_adamw"
    return t, opt, params, opt.init(params), _grads(rng, params, 1.0)


def _plain(t):
    """The same AdamW as optax's chain: apply_if_finite runs it through optax.update and a cond."""
    opt = make_optimizer(ConfigDict({**t.to_dict(), "optimizer": "optax_adamw"}))
    assert opt.impl == "optax_adamw" and not hasattr(opt, "apply_in_place")
    return opt


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-7), a, b)


@needs_kernels
@pytest.mark.parametrize("clip,scale,unrolled", [(1.0, 0.01, ()), (1.0, 1.0, ()), (0.0, 1.0, ()),
                                                 (1.0, 1.0, ("moe_layers",))])  # clip not hit, hit, off; by layer
def test_steps_match_optax(clip, scale, unrolled):
    rng = np.random.default_rng(0)
    t = _train_cfg(grad_clip=clip)
    params = _params(rng)
    opt, ref = make_optimizer(t, params=params), _plain(t)
    ref_p, ref_s = params, ref.init(params)
    p, s = params, opt.init(params)
    assert jax.tree.structure(s) == jax.tree.structure(ref_s)   # one state tree: checkpoints move between them
    fused = jax.jit(lambda p, s, g: opt.apply_in_place(p, s, g, jnp.bool_(True), unrolled=unrolled))
    # one kernel call per trained leaf; per layer of the 3-layer stacks when unrolled (at offsets that
    # are not multiples of 16: the attn kernel's layers are 192 long, the router's 32)
    calls = fused.lower(p, s, _grads(rng, params, scale)).as_text().count(f"custom_call @{cpu_kernels.ADAMW}(")
    assert calls == (2 + 3 * 3 if unrolled else 5)
    for _ in range(4):  # through warmup into the cosine decay, moments far from zero
        g = _grads(rng, params, scale)
        upd, ref_s = ref.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, upd)
        p, s = fused(p, s, g)
        _close(p, ref_p)
        _close(s, ref_s)
    assert jax.tree.structure(s) == jax.tree.structure(ref_s)
    np.testing.assert_array_equal(p["moe_layers"]["moe"]["router_bias"], params["moe_layers"]["moe"]["router_bias"])
    assert not np.allclose(p["embed"], params["embed"])


@needs_kernels
def test_nonfinite_step_leaves_params_and_state_unchanged():
    t, opt, params, state, g = _setup(1)
    p1, s1 = jax.jit(lambda p, s, g: opt.apply_in_place(p, s, g, jnp.bool_(True)))(params, state, g)
    g_bad = {**g, "embed": g["embed"].at[3, 1].set(jnp.nan)}
    step = jax.jit(lambda p, s, g: apply_if_finite(opt, p, s, g, jnp.float32(1.0)))
    p2, s2, finite, _ = step(p1, s1, g_bad)
    assert not bool(finite)
    jax.tree.map(np.testing.assert_array_equal, (p2, s2), (p1, s1))
    p3, s3, finite, _ = step(p2, s2, g)  # and the next good step matches optax from there
    upd, ref_s = _plain(t).update(g, s1, p1)
    _close(p3, optax.apply_updates(p1, upd))
    _close(s3, ref_s)


@needs_kernels
def test_apply_if_finite_gates_after_on_the_fused_path():
    t, opt, params, state, g = _setup(2)

    def after(p):
        moe = {**p["moe_layers"]["moe"], "router_bias": p["moe_layers"]["moe"]["router_bias"] + 1.0}
        return {**p, "moe_layers": {**p["moe_layers"], "moe": moe}}
    for loss, moved in ((1.0, True), (np.nan, False)):
        fused_fn = jax.jit(lambda p, s, g: apply_if_finite(opt, p, s, g, jnp.float32(loss), after))
        ref_fn = jax.jit(lambda p, s, g: apply_if_finite(_plain(t), p, s, g, jnp.float32(loss), after))
        assert cpu_kernels.ADAMW in fused_fn.lower(params, state, g).as_text()
        assert cpu_kernels.ADAMW not in ref_fn.lower(params, state, g).as_text()
        fused, ref = fused_fn(params, state, g), ref_fn(params, state, g)
        _close(fused[:2], ref[:2])
        bias = fused[0]["moe_layers"]["moe"]["router_bias"]
        np.testing.assert_array_equal(bias, params["moe_layers"]["moe"]["router_bias"] + (1.0 if moved else 0.0))


def test_pinned_fused_where_it_cannot_run_raises_its_reason():
    p16 = {"w": jnp.ones((4,), jnp.bfloat16)}
    with pytest.raises(KernelUnavailable, match="cpu_fused_adamw.*float32.*bfloat16.*optax_adamw"):
        make_optimizer(_train_cfg(optimizer="cpu_fused_adamw"), params=p16)
    with pytest.raises(KernelUnavailable, match="cpu_fused_adamw.*target is tpu"):
        make_optimizer(_train_cfg(optimizer="cpu_fused_adamw"), Target("tpu"))
    with pytest.raises(KernelUnavailable, match="one device only"):
        make_optimizer(_train_cfg(optimizer="cpu_fused_adamw"), Target("cpu", (("data", 2),)))
    with pytest.raises(KernelUnavailable, match="train.optimizer=.*not an implementation of optimizer.*optax_adamw"):
        make_optimizer(_train_cfg(optimizer="adafactor"))


def test_auto_picks_optax_where_the_fused_step_cannot_run():
    assert make_optimizer(_train_cfg(), Target("tpu")).impl == "optax_adamw"
    assert make_optimizer(_train_cfg(), Target("gpu")).impl == "optax_adamw"
    assert make_optimizer(_train_cfg(), Target("cpu", (("fsdp", 4),))).impl == "optax_adamw"
    assert make_optimizer(_train_cfg(), params={"w": jnp.ones((4,), jnp.bfloat16)}).impl == "optax_adamw"
    assert make_optimizer(_train_cfg(optimizer="optax_adamw")).impl == "optax_adamw"
    expect = "cpu_fused_adamw" if cpu_kernels.unavailable() is None else "optax_adamw"
    assert make_optimizer(_train_cfg(), Target("cpu", (("data", 1),)), {"w": jnp.ones((4,))}).impl == expect


def test_train_optimizer_is_a_checked_config_choice():
    for name in ("auto", "optax_adamw", "cpu_fused_adamw"):
        assert load_config("configs/tiny.py", [f"--config.train.optimizer={name}"]).train.optimizer == name
    with pytest.raises(ConfigError, match="train.optimizer.*cpu_fused_adamw"):
        load_config("configs/tiny.py", ["--config.train.optimizer=fused"])
    from c2jax.ops.optimizer import OPTIMIZER
    assert set(OPTIMIZER.names()) == {"optax_adamw", "cpu_fused_adamw"}   # config's list (c2jax/config.py)


@needs_kernels
def test_fused_made_for_one_target_refuses_a_step_it_cannot_run():
    """Made without params, the dtypes are checked where the step is traced: no silent swap to optax."""
    opt = make_optimizer(_train_cfg())
    assert opt.impl == "cpu_fused_adamw"
    p16 = {"w": jnp.ones((4, 16), jnp.bfloat16)}
    g16 = jax.tree.map(jnp.ones_like, p16)
    with pytest.raises(KernelUnavailable, match="float32.*make_optimizer\\(cfg.train, target_of_mesh"):
        jax.jit(lambda p, s, g: apply_if_finite(opt, p, s, g, jnp.float32(1.0))).lower(p16, opt.init(p16), g16)


@needs_kernels
def test_fused_through_plain_optax_matches_optax_adamw():
    """init / update / optax.apply_updates, as any optax user would (jitted and eager), over steps
    through warmup into the decay, the clip hit, a frozen leaf; the kernel runs in update."""
    t, opt, params, _, _ = _setup(6)
    ref = _plain(t)
    rng = np.random.default_rng(7)
    upd_fn = jax.jit(opt.update)
    assert cpu_kernels.ADAMW in upd_fn.lower(_grads(rng, params, 1.0), opt.init(params), params).as_text()
    p, s, ref_p, ref_s = params, opt.init(params), params, ref.init(params)
    for i in range(5):
        g = _grads(rng, params, 3.0)
        upd, s = (upd_fn if i % 2 else opt.update)(g, s, p)
        p = optax.apply_updates(p, upd)
        ref_upd, ref_s = ref.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, ref_upd)
        _close(p, ref_p)
        _close(s, ref_s)
    np.testing.assert_array_equal(upd["moe_layers"]["moe"]["router_bias"], 0.0)
    with pytest.raises(ValueError, match="needs the params"):
        opt.update(g, s)


@needs_kernels
def test_apply_if_finite_records_the_optimizer_that_runs():
    """record_choices() while a step is traced: the optimizer each config chooses, once, and only
    the fused one puts the kernel in the program (the train step's record: the unrolled test below)."""
    t, opt, params, state, g = _setup(8)
    for o in (opt, _plain(t)):
        with record_choices() as rec:
            hlo = jax.jit(lambda p, s, g, o=o: apply_if_finite(o, p, s, g, jnp.float32(1.0))).lower(
                params, state, g).as_text()
        assert rec == {"optimizer": {o.impl: 1}}, rec
        assert (cpu_kernels.ADAMW in hlo) == (o.impl == "cpu_fused_adamw")


@needs_kernels
def test_apply_if_finite_matches_optax_without_frozen_leaves():
    """No frozen leaf: the clip reuses apply_if_finite's gradient norm (clip hit here)."""
    t, opt, params, state, g = _setup(3)
    params = {k: v for k, v in params.items() if k != "moe_layers"}
    params["w"] = jnp.asarray(np.random.default_rng(4).normal(size=(8, 32)), jnp.float32)
    state, g = opt.init(params), _grads(np.random.default_rng(5), params, 10.0)
    fused_fn = jax.jit(lambda p, s, g: apply_if_finite(opt, p, s, g, jnp.float32(1.0)))
    assert cpu_kernels.ADAMW in fused_fn.lower(params, state, g).as_text()  # the fused path, not optax's
    fused = fused_fn(params, state, g)
    ref = jax.jit(lambda p, s, g: apply_if_finite(_plain(t), p, s, g, jnp.float32(1.0)))(params, state, g)
    assert float(fused[3]) > t.grad_clip
    _close(fused[:2], ref[:2])


@needs_kernels
def test_offset_past_the_end_is_refused():
    p = jnp.ones((3, 32), jnp.float32)
    coef = jnp.asarray([1, 0, 1, 1, 0.1, 0.05, -1e-3], jnp.float32)
    with pytest.raises(Exception, match="g at offset runs past the end of p"):
        jax.jit(lambda p, g: cpu_adamw._leaf_step(p, g, p, p, coef, adamw_of(_train_cfg()), 0.0, offset=80))(p, p[0])


@needs_kernels
def test_unrolled_train_step_steps_layers_without_concatenating_their_gradients():
    """The tiny model, layers unrolled: each stacked leaf's gradient goes to the optimizer layer by
    layer, with no concatenation of the stacked expert gradients and no copy of the stacked
    weights in the compiled step, and the step gives what the scanned (looped) layers give."""
    from c2jax.config import load_config
    from c2jax.models import init_params
    from c2jax.train.step import init_state, train_step
    base = ["--config.model.dtype=float32", "--config.model.param_dtype=float32", "--config.train.warmup_steps=0",
            "--config.model.moe_dispatch=capacity"]
    cfgs = {u: load_config("configs/tiny.py", base + [f"--config.model.scan_unroll={u}"]) for u in (1, 8)}
    m = cfgs[8].model
    assert cfgs[8].model.num_layers <= 8 and cfgs[8].model.num_experts > 0
    rng = np.random.default_rng(0)
    B, L = 2, 32
    ids = rng.integers(0, m.vocab_size, (B, L + 1)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.ones((B, L), np.int32),
             "positions": np.arange(L, dtype=np.int32)[None].repeat(B, 0), "loss_weights": np.ones((B, L), np.float32)}
    params = init_params(cfgs[1], jax.random.key(0))
    out = {}
    for u, cfg in cfgs.items():
        opt = make_optimizer(cfg.train, params=params)
        assert opt.impl == "cpu_fused_adamw"
        step = jax.jit(lambda s, b, cfg=cfg, opt=opt: train_step(cfg, opt, s, b), donate_argnums=(0,))  # as the trainer
        state = init_state(cfg, opt, jax.tree.map(jnp.copy, params), 0)   # donated: its own buffers
        with record_choices() as rec:
            hlo = step.lower(state, batch).compile().as_text()
        assert rec["optimizer"] == {"cpu_fused_adamw": 1}, rec
        w_gate = params["moe_layers"]["block"]["moe"]["w_gate"]
        stacked = "f32[" + ",".join(map(str, w_gate.shape)) + "]"
        concats = [ln for ln in hlo.splitlines() if "concatenate" in ln and f"= {stacked}" in ln]
        # the params' in-place update is ordered after every read of them (param_norm included):
        # no copy of the stacked weights on entry
        copies = [ln for ln in hlo.splitlines() if f"= {stacked}" in ln and " copy(" in ln]
        if u == 8:
            assert hlo.count(f'custom_call_target="{cpu_kernels.ADAMW}"') > len(jax.tree.leaves(params))
            assert not concats, concats[:1]
            assert not copies, copies[:1]
        out[u] = step(state, batch)
    np.testing.assert_allclose(out[8][1]["loss"], out[1][1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(out[8][1]["grad_norm"], out[1][1]["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out[8][0]["params"],
                 out[1][0]["params"])
