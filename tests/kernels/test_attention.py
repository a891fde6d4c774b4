"""Flash attention (fwd + bwd) and decode attention: Pallas interpret vs the jnp reference."""
# Dim letters: B batch, H q heads, Hk kv heads, L length, D q/k head dim, Dv v head dim, S cache length.
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.decode_attention.reference import decode_attention_reference
from pallas_kernels.flash_attention.reference import attention_reference

BLOCKS = (128, 128, 128, 128)  # L=200 -> padded to 256: 2x2 blocks, exercises causal skipping


def _qkv(b, h, hk, l, d, dv, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, h, l, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hk, l, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hk, l, dv)), dtype)
    do = jnp.asarray(rng.standard_normal((b, h, l, dv)), dtype)
    return q, k, v, do


CASES = [
    # name, (B, H, Hk, L, D, Dv), segments, causal
    ("gqa_segments", (1, 4, 2, 200, 64, 64), [70, 90, 40], True),     # L not a multiple of the block
    ("mla_shape", (1, 2, 2, 130, 192, 128), None, True),               # MLA head dims
    ("gqa_noncausal", (2, 2, 1, 128, 64, 64), [50, 78], False),
]


@pytest.mark.parametrize("name,shape,segs,causal", CASES, ids=[c[0] for c in CASES])
def test_flash_attention_forward_and_grads(name, shape, segs, causal):
    b, h, _hk, l, _d, dv = shape
    q, k, v, do = _qkv(*shape)
    seg = None if segs is None else jnp.asarray(np.tile(np.repeat(np.arange(len(segs)), segs), (b, 1)), jnp.int32)


    out, vjp = jax.jit(lambda q, k, v: jax.vjp(functools.partial(
        pk.flash_attention, segment_ids_BL=seg, causal=causal, impl="interpret", block_sizes=BLOCKS), q, k, v))(q, k, v)
    grads = jax.jit(vjp)(do)
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, seg, causal), q, k, v)
    ref_grads = ref_vjp(do)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=1e-5)
    for g, r, nm in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=f"d{nm}")
    assert out.shape == (b, h, l, dv)


def test_flash_attention_bf16_forward():
    q, k, v, _ = _qkv(1, 2, 1, 256, 128, 128, seed=1, dtype=jnp.bfloat16)
    out = jax.jit(functools.partial(pk.flash_attention, impl="interpret", block_sizes=BLOCKS))(q, k, v)
    ref = attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_xla_chunked_path_matches_reference(causal):
    from pallas_kernels.flash_attention.xla import attention_xla

    q, k, v, do = _qkv(2, 4, 2, 70, 32, 16, seed=2)
    seg = jnp.asarray(np.tile(np.repeat([0, 1], [25, 45]), (2, 1)), jnp.int32)
    f = lambda fn: jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(fn(q, k, v) * do), argnums=(0, 1, 2)))
    o, g = f(lambda q, k, v: attention_xla(q, k, v, seg, causal, chunk=32))(q, k, v)  # 3 chunks, padded
    r, rg = f(lambda q, k, v: attention_reference(q, k, v, seg, causal))(q, k, v)
    np.testing.assert_allclose(o, r, rtol=1e-5)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("shape,lengths", [
    ((3, 8, 2, 300, 64, 64), [0, 130, 300]),     # GQA; empty row; S not a multiple of the block
    ((2, 4, 4, 256, 192, 128), [1, 200]),        # MLA head dims
    ((2, 8, 2, 384, 128, 128), [77, 240]),       # lane-tile head dims: the BSHD cache is read in place
])
def test_decode_attention(shape, lengths):
    b, h, hk, s, d, dv = shape
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((b, hk, s, d)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((b, hk, s, dv)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    ref = decode_attention_reference(q, kc, vc, lens)
    out = jax.jit(functools.partial(pk.decode_attention, impl="interpret", block_s=128))(q, kc, vc, lens)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(pk.decode_attention(q, kc, vc, lens, impl="xla"), ref, atol=1e-6)
    # garbage past the length must not matter
    kc2 = kc.at[:, :, 250:].set(1e4)
    out2 = jax.jit(functools.partial(pk.decode_attention, impl="interpret", block_s=128))(q, kc2, vc, lens)
    np.testing.assert_array_equal(np.asarray(out2)[:2], np.asarray(out)[:2])
    if lengths[0] == 0:
        assert np.all(np.asarray(out)[0] == 0)
    # the model's [B, S, Hk, D] cache layout, read in place where D fills whole lane tiles
    in_model_layout = jax.jit(functools.partial(pk.decode_attention, impl="interpret", block_s=128,
                                                cache_layout="BSHD"))
    np.testing.assert_allclose(in_model_layout(q, kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3), lens), ref,
                               atol=2e-5, rtol=1e-5)
    # decode == last row of causal attention over the first `length` positions
    i = b - 1
    n = lengths[i]
    full = attention_reference(q[i:i + 1, :, None, :].repeat(n, 2), kc[i:i + 1, :, :n], vc[i:i + 1, :, :n], causal=False)
    np.testing.assert_allclose(out[i], full[0, :, -1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("b,h,s,c,r,lengths", [(3, 8, 300, 64, 16, [0, 130, 300]), (2, 16, 256, 128, 64, [1, 256])])
def test_mla_decode_attention(b, h, s, c, r, lengths):
    """The latent-space MLA decode kernel (interpreted) equals its reference, and both equal the
    GQA decode reference with one kv head whose keys are [latent, k_rope] and values the latents."""
    rng = np.random.default_rng(4)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    qa, qr, lat, rope = f(b, h, c), f(b, h, r), f(b, s, c), f(b, s, r)
    lens = jnp.asarray(lengths, jnp.int32)
    scale = (c + r) ** -0.5
    run = jax.jit(functools.partial(pk.mla_decode_attention, sm_scale=scale, impl="interpret", block_s=128))
    out = run(qa, qr, lat, rope, lens)
    ref = pk.mla_decode_attention(qa, qr, lat, rope, lens, sm_scale=scale, impl="xla")
    as_gqa = decode_attention_reference(jnp.concatenate([qa, qr], -1), jnp.concatenate([lat, rope], -1)[:, None],
                                        lat[:, None], lens, scale)
    np.testing.assert_allclose(ref, as_gqa, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
    garbage = run(qa, qr, lat.at[:, 260:].set(1e4), rope.at[:, 260:].set(-1e4), lens)   # past every length < 260
    np.testing.assert_array_equal(np.asarray(garbage)[:2], np.asarray(out)[:2])
    if lengths[0] == 0:
        assert np.all(np.asarray(out)[0] == 0)
    with pytest.raises(ValueError, match="k_rope_BSR"):
        pk.mla_decode_attention(qa, qr, lat, rope[:, :-1], lens, sm_scale=scale, impl="xla")


def test_attention_bad_inputs_raise_value_error():
    q, k, v, _ = _qkv(1, 3, 2, 16, 8, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        pk.flash_attention(q, k, v, impl="xla")
    q, k, v, _ = _qkv(1, 4, 2, 16, 8, 8)
    with pytest.raises(ValueError, match="k_BHSD"):
        pk.flash_attention(q, k[..., :4], v, impl="xla")
    with pytest.raises(ValueError, match="segment_ids_BL"):
        pk.flash_attention(q, k, v, segment_ids_BL=jnp.zeros((1, 15), jnp.int32), impl="xla")
    with pytest.raises(ValueError, match="impl"):
        pk.flash_attention(q, k, v, impl="triton")
    with pytest.raises(ValueError, match="lengths_B"):
        pk.decode_attention(q[:, :, 0], k, v, jnp.zeros((2,), jnp.int32), impl="xla")
    with pytest.raises(ValueError, match="q_BHD"):
        pk.decode_attention(q, k, v, jnp.zeros((1,), jnp.int32), impl="xla")
