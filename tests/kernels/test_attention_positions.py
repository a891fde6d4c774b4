"""Flash attention with explicit positions and separate query / key segment ids (context parallelism:
local queries against all-gathered keys in a zigzag token order, Lq < Lk): Pallas (interpret), XLA
and reference paths, forward and gradients, the block-skip schedule, and argument errors."""
# Dim letters: B batch, H q heads, Hk kv heads, L query length, S key length, D q/k head dim,
# E v head dim, R context-parallel ranks, C tokens per zigzag chunk.
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.flash_attention import tpu as fa_tpu
from pallas_kernels.flash_attention.reference import attention_mask, attention_reference
from pallas_kernels.flash_attention.xla import attention_xla

ORPHAN_SEG = 99  # a query segment no key has: those rows see no key


def zigzag_case(b, h, hk, d, e, ranks, chunk, rank, seed, n_orphans=5):
    """Rank `rank`'s queries (zigzag chunks rank and 2R-1-rank) against all keys gathered in rank
    order; documents split at random positions; a few queries in a segment no key has."""
    rng = np.random.default_rng(seed)
    order = [c for r in range(ranks) for c in (r, 2 * ranks - 1 - r)]
    pos_S = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in order])
    s, l = 2 * ranks * chunk, 2 * chunk
    kv_pos_BS = np.tile(pos_S, (b, 1)).astype(np.int32)
    q_pos_BL = kv_pos_BS[:, rank * l:(rank + 1) * l].copy()
    seg_by_pos = np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, s), 3, replace=False)),
                                           np.arange(s), side="right") for _ in range(b)])
    kv_seg_BS = np.take_along_axis(seg_by_pos, kv_pos_BS, 1).astype(np.int32)
    q_seg_BL = np.take_along_axis(seg_by_pos, q_pos_BL, 1).astype(np.int32)
    orphans = rng.choice(l, n_orphans, replace=False)
    q_seg_BL[:, orphans] = ORPHAN_SEG
    masks = dict(q_segment_ids_BL=jnp.asarray(q_seg_BL), kv_segment_ids_BS=jnp.asarray(kv_seg_BS),
                 q_positions_BL=jnp.asarray(q_pos_BL), kv_positions_BS=jnp.asarray(kv_pos_BS))
    q = jnp.asarray(rng.standard_normal((b, h, l, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hk, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hk, s, e)), jnp.float32)
    do = jnp.asarray(rng.standard_normal((b, h, l, e)), jnp.float32)
    return (q, k, v, do), masks, orphans


def _fwd_and_grads(fn, q, k, v, do):
    out, vjp = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v))(q, k, v)
    return out, jax.jit(vjp)(do)


def _assert_matches_reference(fn, args, masks, orphans, atol_out, atol_grad):
    q, k, v, do = args
    out, grads = _fwd_and_grads(fn, q, k, v, do)
    ref_out, ref_grads = _fwd_and_grads(lambda q, k, v: attention_reference(q, k, v, **masks), q, k, v, do)
    np.testing.assert_allclose(out, ref_out, atol=atol_out, rtol=1e-5)
    for g, r, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(g, r, atol=atol_grad, rtol=1e-4, err_msg=name)
    # queries that see no key: exactly 0 output and 0 dq, never NaN
    assert np.all(np.asarray(out)[:, :, orphans] == 0)
    assert np.all(np.asarray(grads[0])[:, :, orphans] == 0)


@pytest.mark.parametrize("schedule", ["table", "bounds"])
def test_flash_positions_zigzag_interpret_matches_reference(schedule, monkeypatch):
    """Lq=160 local queries (padded to 3 blocks of 64) vs Lk=320 gathered keys (5 blocks); GQA, D != E.
    "table": SMEM schedule that skips compute and DMA; "bounds": the fallback for large schedules."""
    if schedule == "bounds":
        monkeypatch.setattr(fa_tpu, "SCHEDULE_MAX_ENTRIES", 0)
    args, masks, orphans = zigzag_case(b=1, h=2, hk=1, d=32, e=16, ranks=2, chunk=80, rank=0, seed=1)
    fn = lambda q, k, v: pk.flash_attention(q, k, v, impl="interpret", block_sizes=(64, 64, 64, 64), **masks)
    _assert_matches_reference(fn, args, masks, orphans, 2e-5, 1e-4)


def test_flash_positions_xla_paths_match_reference():
    """The chunked XLA path (3 query chunks, one padded) and the dispatcher's XLA route; B=2 rows
    with different documents; the last rank's queries."""
    args, masks, orphans = zigzag_case(b=2, h=4, hk=2, d=16, e=8, ranks=2, chunk=40, rank=1, seed=2)
    chunked = lambda q, k, v: attention_xla(q, k, v, chunk=32, **masks)
    _assert_matches_reference(chunked, args, masks, orphans, 1e-5, 1e-5)
    routed = lambda q, k, v: pk.flash_attention(q, k, v, impl="xla", **masks)
    _assert_matches_reference(routed, args, masks, orphans, 1e-6, 1e-6)


def test_flash_positions_equal_to_indices_match_index_causal_kernel():
    """Positions = indices and q/kv segment ids = segment_ids_BL give the index-causal kernel's result."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 128, 32)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.repeat([0, 1], [50, 78])[None], jnp.int32)
    pos = jnp.arange(128, dtype=jnp.int32)[None]
    kw = dict(impl="interpret", block_sizes=(64, 64, 64, 64))
    by_pos = jax.jit(lambda q, k, v: pk.flash_attention(
        q, k, v, q_segment_ids_BL=seg, kv_segment_ids_BS=seg, q_positions_BL=pos, kv_positions_BS=pos, **kw))
    by_index = jax.jit(lambda q, k, v: pk.flash_attention(q, k, v, segment_ids_BL=seg, **kw))
    np.testing.assert_allclose(by_pos(q, k, v), by_index(q, k, v), atol=1e-6, rtol=1e-6)


def test_block_schedule_is_sound_and_skips():
    """Every block pair holding a visible (query, key) pair is scheduled; zigzag leaves others out;
    a skipped step fetches a block the previous step already holds (no new DMA)."""
    _, masks, _ = zigzag_case(b=2, h=1, hk=1, d=8, e=8, ranks=4, chunk=64, rank=1, seed=4, n_orphans=0)
    q_seg, kv_seg = masks["q_segment_ids_BL"], masks["kv_segment_ids_BS"]
    q_pos, kv_pos = masks["q_positions_BL"], masks["kv_positions_BS"]
    b, lq = q_seg.shape
    lk = kv_seg.shape[1]
    bq, bk = 64, 128
    lay = fa_tpu._layout(b, lq, lk, q_seg, kv_seg, q_pos, kv_pos, bq, bk)
    need = np.asarray(fa_tpu._needed_blocks(lay, lq, lk))
    vis = np.asarray(attention_mask(b, lq, lk, q_segment_ids_BL=q_seg, kv_segment_ids_BS=kv_seg,
                                    q_positions_BL=q_pos, kv_positions_BS=kv_pos))
    vis_blocks = vis.reshape(b, lq // bq, bq, lk // bk, bk).any(axis=(2, 4))
    assert need.shape == vis_blocks.shape == (2, 2, 4)
    assert np.all(need[vis_blocks])                # sound: nothing visible is skipped
    assert need.sum() < need.size                  # zigzag early chunk: some key blocks skipped
    for kv_inner, n in ((True, need), (False, np.swapaxes(need, 1, 2))):
        sched = fa_tpu._make_schedule(lay, lq, lk, kv_inner=kv_inner)
        assert sched.table
        tab = np.asarray(sched.arrays[0]).reshape(n.shape)
        np.testing.assert_array_equal(tab & 1, n)
        fetch = tab >> 1
        j = np.arange(n.shape[2])
        assert np.all(np.where(n, fetch == j, True))                    # needed: its own block
        changes = (np.diff(fetch, axis=2) != 0).sum(axis=2) + 1          # distinct consecutive fetches
        assert np.all(changes <= np.maximum(n.sum(axis=2), 1))           # skipped steps add no DMA


def test_mask_argument_errors():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, 2, 16, 8)), jnp.float32)
    k = v = jnp.asarray(rng.standard_normal((1, 1, 32, 8)), jnp.float32)
    pos_q, pos_k = jnp.arange(16, dtype=jnp.int32)[None], jnp.arange(32, dtype=jnp.int32)[None]
    seg_q, seg_k = jnp.zeros((1, 16), jnp.int32), jnp.zeros((1, 32), jnp.int32)
    call = lambda **kw: pk.flash_attention(q, k, v, impl="xla", **kw)
    with pytest.raises(ValueError, match="q_positions_BL and kv_positions_BS"):
        call()  # causal with Lq != Lk needs positions
    with pytest.raises(ValueError, match="both q_positions_BL and kv_positions_BS"):
        call(q_positions_BL=pos_q)
    with pytest.raises(ValueError, match="both q_segment_ids_BL and kv_segment_ids_BS"):
        call(q_segment_ids_BL=seg_q, q_positions_BL=pos_q, kv_positions_BS=pos_k)
    with pytest.raises(ValueError, match="causal=True"):
        call(q_positions_BL=pos_q, kv_positions_BS=pos_k, causal=False)
    with pytest.raises(ValueError, match="segment_ids_BL needs Lq == Lk"):
        call(segment_ids_BL=seg_q, q_positions_BL=pos_q, kv_positions_BS=pos_k)
    with pytest.raises(ValueError, match="not both"):
        pk.flash_attention(q, q, q, segment_ids_BL=seg_q, q_segment_ids_BL=seg_q, impl="xla")
    with pytest.raises(ValueError, match=r"kv_positions_BS shape"):
        call(q_positions_BL=pos_q, kv_positions_BS=pos_q)
    with pytest.raises(ValueError, match="integer"):
        call(q_positions_BL=pos_q.astype(jnp.float32), kv_positions_BS=pos_k)
    # non-causal cross attention with separate segment ids needs no positions
    out = call(q_segment_ids_BL=seg_q, kv_segment_ids_BS=seg_k, causal=False)
    np.testing.assert_allclose(out, attention_reference(q, k, v, causal=False), atol=1e-6)
