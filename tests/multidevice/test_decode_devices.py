"""Decode over several host devices (Sampler(decode_devices=n), unrolled.split_params with a
mesh): experts split over devices (the CPU kernel's cpu_kernels.PackedExperts by hidden columns, or
experts_xla.ShardedExperts by hidden columns or whole experts), GQA attention split by heads and the
output head by vocab give what one device gives, on fresh random inputs; bad requests fail
with a clear error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import c2jax
from c2jax.ops.experts import decode_layout_experts
from c2jax.config import load_config
from c2jax.ops import experts_xla
from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.sampling import Request, Sampler, unrolled


def _routed_inputs(rng, T, D, F, E, skew, K=2):
    """x [T, D], expert ids and weights [T, K], (w_gate, w_up, w_down); skew: every token picks
    expert 0 (one device / one expert gets every row) plus one other."""
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    if skew:
        ids = np.stack([[0, rng.integers(1, E)] for _ in range(T)])
    else:
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    ws = [jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, jnp.asarray(ids, jnp.int32), wts, ws


@pytest.mark.parametrize("split", ["ffn", "expert"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("T,skew", [(1, False), (8, False), (6, True)])
def test_sharded_split_dispatch_equals_one_device(n, T, skew, split):
    D, F, E = 16, 24, 8
    x, ids, wts, ws = _routed_inputs(np.random.default_rng(10 * n + T), T, D, F, E, skew)
    want, _ = jax.jit(decode_layout_experts)(x, ids, wts, experts_xla.split_experts(*ws))
    mesh = unrolled.decode_mesh(n)
    sharded = jax.device_put(experts_xla.shard_experts(*ws, mesh, split), NamedSharding(mesh, P("decode")))
    assert sharded.split == split
    assert len(sharded.slots) == (E if split == "ffn" else E // n)
    if split == "ffn":  # device d holds hidden columns [d f, (d + 1) f) of gate and of up
        f = F // n
        np.testing.assert_array_equal(sharded.slots[3][0][1], np.concatenate([ws[0][3][:, f:2 * f], ws[1][3][:, f:2 * f]], 1))
        np.testing.assert_array_equal(sharded.slots[3][1][1], ws[2][3][f:2 * f])
    got, dropped = jax.jit(decode_layout_experts)(x, ids, wts, sharded)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, experts_xla.grouped_dispatch(x, ids, wts, *ws)[0], atol=2e-5, rtol=1e-5)
    assert float(dropped) == 0.0


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("T,skew", [(1, False), (8, False), (11, True)])
def test_packed_experts_over_devices_equal_one_device(n, T, skew):
    """The CPU kernel with each device holding 1/n of every expert's hidden columns (then a psum)
    equals the kernel on one device and the XLA dispatch."""
    x, ids, wts, ws = _routed_inputs(np.random.default_rng(100 * n + T), T, 32, 128, 8, skew)  # skew, 11 rows: 2 row blocks
    one = jax.jit(decode_layout_experts)(x, ids, wts, cpu_kernels.pack_experts(*ws))[0]
    mesh = unrolled.decode_mesh(n)
    packed = jax.device_put(cpu_kernels.pack_experts(*ws, mesh), NamedSharding(mesh, P("decode")))
    assert packed.w_gate_up.shape[0] == n and len(packed.w_gate_up.sharding.device_set) == n
    got = jax.jit(decode_layout_experts)(x, ids, wts, packed)[0]
    np.testing.assert_allclose(got, one, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, decode_layout_experts(x, ids, wts, experts_xla.split_experts(*ws))[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", ["columns", "rows"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_packed_matrix_over_devices_equals_one_device(n, split):
    """The CPU kernel's matmul with columns (the output head, q/k/v) or rows (o_proj) split over
    the devices."""
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.standard_normal((11, 8 * n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8 * n, 32 * n * 2)), jnp.float32)
    mesh = unrolled.decode_mesh(n)
    pm = jax.device_put(cpu_kernels.pack_matrix(w, mesh, split), NamedSharding(mesh, P("decode")))
    got = jax.jit(cpu_kernels.matmul)(x, pm)
    assert got.sharding.spec == (P(None, "decode") if split == "columns" else P())
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-5, atol=1e-4)


def test_shard_experts_layout_choice_and_errors():
    mesh = unrolled.decode_mesh(4)
    ws = [jnp.ones(s, jnp.float32) for s in ((8, 16, 6), (8, 16, 6), (8, 6, 16))]  # F = 6: 4 does not divide it
    assert experts_xla.shard_experts(*ws, mesh).split == "expert"
    with pytest.raises(ValueError, match="'ffn' needs 4 to divide 6"):
        experts_xla.shard_experts(*ws, mesh, "ffn")
    ws = [jnp.ones(s, jnp.float32) for s in ((6, 16, 8), (6, 16, 8), (6, 8, 16))]  # E = 6, F = 8
    assert experts_xla.shard_experts(*ws, mesh).split == "ffn"
    with pytest.raises(ValueError, match="'expert' needs 4 to divide 6"):
        experts_xla.shard_experts(*ws, mesh, "expert")


def _generate(cfg, params, n, swap=None):
    s = Sampler(cfg, params, max_batch=8, max_len=64, chunk=6, decode_devices=n)
    rng = np.random.default_rng(0)
    rids = [s.submit(Request(rng.integers(0, cfg.model.vocab_size, 5 + 3 * i).tolist(), max_new_tokens=16,
                             temperature=t, n=2, seed=7)) for i, t in enumerate((0.0, 1.0, 0.7))]
    # stop strings rewind a row's state between decode chunks, where it lies (on the decode mesh)
    rids.append(s.submit(Request(rng.integers(0, cfg.model.vocab_size, 6).tolist(), max_new_tokens=16, temperature=1.0,
                                 n=4, seed=3, stop_strings=["ab"], detokenize=lambda ids: "".join("abcd"[t % 4] for t in ids))))
    if swap is not None:
        s.step_chunk()
        s.swap_params(swap, 1)
        # a request arriving after decoding started: its prefill needs the cache back home
        rids.append(s.submit(Request(rng.integers(0, cfg.model.vocab_size, 7).tolist(), max_new_tokens=8,
                                     temperature=1.0, n=2, seed=9)))
    s.run_until_done()
    return s, [c for r in rids for c in s.results(r)]


@pytest.mark.parametrize("preset,n,layout", [("configs/tiny.py", 2, "packed"), ("configs/tiny.py", 4, "packed"),
                                             ("configs/tiny.py:mla", 2, "packed"), ("configs/tiny.py:mla", 4, "packed"),
                                             ("configs/tiny.py", 2, "split"), ("configs/tiny.py:mla", 4, "split")])
def test_sampler_over_devices_matches_one_device(preset, n, layout, monkeypatch, wide_cpu_kernels):
    """Greedy and sampled tokens, expert ids and policy versions equal one device's (a weight swap
    mid-generation included); behaviour logprobs agree to float32 rounding. Experts as the CPU
    kernel's PackedExperts (the default here) and as ShardedExperts (kernel off)."""
    if layout == "split":
        monkeypatch.setattr(cpu_kernels, "unavailable", lambda: "off in this test")
    cfg = load_config(preset)
    params = c2jax.models.init_params(cfg, jax.random.key(1))
    new = jax.tree.map(lambda a: a * 1.05, params)
    _, want = _generate(cfg, params, 1, swap=new)
    s, got = _generate(cfg, params, n, swap=new)
    assert len(got) == len(want) == 12 and "stop_string" in {c.finish_reason for c in want}
    for a, b in zip(want, got):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.versions, b.versions)
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
    assert {int(v) for c in got for v in c.versions} == {0, 1} and set(got[-1].versions) == {1}
    assert all("ab" not in "".join("abcd"[t % 4] for t in c.tokens[:-1]) for c in got[6:10])
    # the weights really are split: experts over the devices, GQA heads and the vocab too
    assert s.weights.layout == layout
    lay = s.weights.split.prepared["layers"][-1]
    ex = lay["moe"]["experts"]
    if layout == "packed":
        assert isinstance(ex, cpu_kernels.PackedExperts) and ex.w_gate_up.sharding.spec == P("decode")
    else:
        assert isinstance(ex, experts_xla.ShardedExperts) and ex.slots[0][0].sharding.spec == P("decode")
    m = s.model_cfg
    if layout == "packed":  # the output head: vocab columns over the devices
        head = s.weights.split.prepared["lm_head"]["kernel"]
        assert isinstance(head, cpu_kernels.PackedMatrix) and head.w.sharding.spec == P("decode")
    if m.attention != "mla" and m.num_kv_heads % n == 0 and layout == "packed":
        q, o = lay["attn"]["q_proj"]["kernel"], lay["attn"]["o_proj"]["kernel"]
        assert (q.split, o.split) == ("columns", "rows") and q.w.sharding.spec == o.w.sharding.spec == P("decode")
    elif m.attention != "mla" and m.num_kv_heads % n == 0:   # float kernels, in the params
        attn = s.weights.split.params["layers"][-1]["attn"]
        assert attn["q_proj"]["kernel"].sharding.spec == P(None, "decode")
        assert attn["o_proj"]["kernel"].sharding.spec == P("decode", None)
    # after decoding the cache stays on the decode devices until a prefill needs it
    assert len(jax.tree.leaves(s.cache)[0].sharding.device_set) == n


def test_bad_decode_device_requests_fail_clearly():
    cfg = load_config("configs/tiny.py")
    params = c2jax.models.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="num_experts"):
        Sampler(cfg, params, decode_devices=3)            # 8 experts over 3 devices
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        Sampler(cfg, params, decode_devices=len(jax.devices()) + 1)
    with pytest.raises(ValueError, match="split decode"):
        Sampler(cfg, params, decode_devices=2, split_decode=False)


def test_rl_sampler_service_decodes_over_devices():
    """rl.sampler_decode_devices reaches the RL sampler service: its completions equal one device's."""
    from c2jax.rl.rollout import SamplerService
    cfg = load_config("configs/tiny.py")
    params = c2jax.models.init_params(cfg, jax.random.key(3))
    prompt = np.random.default_rng(3).integers(0, cfg.model.vocab_size, 9).tolist()
    got = {}
    for n in (1, 2):
        svc = SamplerService(cfg, params, 0, max_batch=4, max_len=48, chunk=8, decode_devices=n)
        try:
            got[n] = svc.submit(Request(prompt, max_new_tokens=12, temperature=1.0, n=4, seed=5)).result(timeout=300)
            assert svc.sampler._mesh is None if n == 1 else svc.sampler._mesh.size == 2
        finally:
            svc.stop()
    for a, b in zip(got[1], got[2]):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


@pytest.mark.parametrize("preset", ["configs/tiny.py", "configs/tiny.py:mla"])
def test_slot_continuation_over_devices_matches_one_device(preset):
    """A later turn continues a finished row's cache on the decode devices (only the appended
    tokens are prefilled; the cached prefix comes from the mesh's cache) exactly as on one device."""
    cfg = load_config(preset)
    params = c2jax.models.init_params(cfg, jax.random.key(2))
    prompt = np.random.default_rng(4).integers(0, cfg.model.vocab_size, 9).tolist()

    def turns(n):
        s = Sampler(cfg, params, max_batch=4, max_len=64, chunk=4, decode_devices=n)
        first = s.results(_submit_run(s, prompt))[0]
        ctx2 = prompt + first.tokens + [30, 31, 32]
        rid = s.submit(Request(ctx2, max_new_tokens=6, temperature=0.0))
        s._admit()   # the prefill alone: on decode devices the cache stays there (only windows move)
        assert all(len(a.sharding.device_set) == n for a in jax.tree.leaves(s.cache))
        s.run_until_done()
        second = s.results(rid)[0]
        assert s.prefill_tokens == len(prompt) + 3 and second.prefilled == 3
        return first, second

    for a, b in zip(turns(1), turns(2)):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
        np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=2e-5)


def _submit_run(s, prompt):
    rid = s.submit(Request(prompt, max_new_tokens=6, temperature=0.0))
    s.run_until_done()
    return rid
