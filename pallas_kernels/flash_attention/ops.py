"""Differentiable flash attention (custom_vjp over the Pallas forward/backward kernels)."""
# Dim letters: B batch, H q heads, K kv heads, L query length, S key length, D q/k head dim, E v head dim.
from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels._common import cotangent_like, interpret_params
from pallas_kernels.flash_attention import reference, tpu, xla


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, scale, blocks, impl):
    out, _ = tpu.flash_fwd_tpu(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal=causal, sm_scale=scale,
                               block_q=blocks[0], block_k=blocks[1],
                               interpret=interpret_params(impl, q, k, v, q_seg, kv_seg, q_pos, kv_pos))
    return out


# The forward's residuals the backward kernels read besides q / k / v, named so a jax.checkpoint
# policy can keep them (save_only_these_names) instead of rerunning the forward kernel.
RESIDUAL_NAMES = ("flash_out", "flash_lse")


def _flash_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, scale, blocks, impl):
    out, lse = tpu.flash_fwd_tpu(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal=causal, sm_scale=scale,
                                 block_q=blocks[0], block_k=blocks[1],
                                 interpret=interpret_params(impl, q, k, v, q_seg, kv_seg, q_pos, kv_pos))
    out, lse = checkpoint_name(out, RESIDUAL_NAMES[0]), checkpoint_name(lse, RESIDUAL_NAMES[1])
    return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)


def _flash_bwd(causal, scale, blocks, impl, res, do):
    q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse = res
    # The backward kernels pad lse for their own blocks: pass it on the true length.
    dq, dk, dv = tpu.flash_bwd_tpu(q, k, v, q_seg, out, lse[..., : q.shape[2]], do, kv_seg_BS=kv_seg,
                                   q_pos_BL=q_pos, kv_pos_BS=kv_pos, causal=causal, sm_scale=scale,
                                   block_q=blocks[2], block_k=blocks[3],
                                   interpret=interpret_params(impl, q, k, v, q_seg, kv_seg, q_pos, kv_pos, do))
    # inside shard_map: e.g. all-gathered keys vary over fewer axes than the local queries
    return (cotangent_like(dq, q), cotangent_like(dk, k), cotangent_like(dv, v), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)

DEFAULT_BLOCKS = (tpu.DEFAULT_BLOCK_Q, tpu.DEFAULT_BLOCK_K, tpu.DEFAULT_BWD_BLOCK_Q, tpu.DEFAULT_BWD_BLOCK_K)


def flash_attention_op(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, causal, scale, impl, blocks=DEFAULT_BLOCKS):
    """Route to the reference/XLA path (autodiff) or the Pallas kernels (custom_vjp).

    q_seg/kv_seg: both or neither; q_pos/kv_pos: both or neither (causal by position).
    """
    masks = dict(q_segment_ids_BL=q_seg, kv_segment_ids_BS=kv_seg, q_positions_BL=q_pos, kv_positions_BS=kv_pos)
    if impl == "reference":
        return reference.attention_reference(q, k, v, causal=causal, sm_scale=scale, **masks)
    if impl == "xla":
        return xla.attention_xla(q, k, v, causal=causal, sm_scale=scale, **masks)
    return _flash(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, scale, tuple(blocks), impl)
