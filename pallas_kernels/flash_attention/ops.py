"""Differentiable flash attention (custom_vjp over the Pallas forward/backward kernels)."""
# Dim letters: B batch, H q heads, K kv heads, L length, D q/k head dim, E v head dim.
from __future__ import annotations

import functools

import jax

from pallas_kernels._common import interpret_params
from pallas_kernels.flash_attention import reference, tpu, xla


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, seg, causal, scale, blocks, impl):
    out, _ = tpu.flash_fwd_tpu(q, k, v, seg, causal=causal, sm_scale=scale, block_q=blocks[0],
                               block_k=blocks[1], interpret=interpret_params(impl))
    return out


def _flash_fwd(q, k, v, seg, causal, scale, blocks, impl):
    out, lse = tpu.flash_fwd_tpu(q, k, v, seg, causal=causal, sm_scale=scale, block_q=blocks[0],
                                 block_k=blocks[1], interpret=interpret_params(impl))
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(causal, scale, blocks, impl, res, do):
    q, k, v, seg, out, lse = res
    # The backward kernels pad lse for their own blocks: pass it on the true length.
    dq, dk, dv = tpu.flash_bwd_tpu(q, k, v, seg, out, lse[..., : q.shape[2]], do, causal=causal,
                                   sm_scale=scale, block_q=blocks[2], block_k=blocks[3],
                                   interpret=interpret_params(impl))
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)

DEFAULT_BLOCKS = (tpu.DEFAULT_BLOCK_Q, tpu.DEFAULT_BLOCK_K, tpu.DEFAULT_BWD_BLOCK_Q, tpu.DEFAULT_BWD_BLOCK_K)


def flash_attention_op(q, k, v, seg, *, causal, scale, impl, blocks=DEFAULT_BLOCKS):
    """Route to the reference/XLA path (autodiff) or the Pallas kernels (custom_vjp)."""
    if impl == "reference":
        return reference.attention_reference(q, k, v, seg, causal=causal, sm_scale=scale)
    if impl == "xla":
        return xla.attention_xla(q, k, v, seg, causal=causal, sm_scale=scale)
    return _flash(q, k, v, seg, causal, scale, tuple(blocks), impl)
