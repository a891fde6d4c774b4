"""Causal self-attention of packed rows for CPU training as two XLA FFI calls (cpu_attention.cc,
built with c2jax.backends.cpu.kernels): a forward that keeps only each query row's log-sum-exp, and
a backward that recomputes the probabilities block by block (flash attention's scheme).

Why: XLA CPU runs the training attention core (attention.causal_block_attention) at ~60 GFLOP/s
of a ~250 GFLOP/s matmul peak: score-shaped products with a 64-wide contraction, row softmaxes
that XLA CPU does not vectorize well, and the dK / dV products over query rows. The kernel keeps
a block's scores in cache between the products and the softmax (experiments/bench/README.md has
the figures). Same visibility rule as causal_block_attention: key j is seen by query i when j
is not past i's query block, pos[j] <= pos[i] and seg[j] == seg[i].

Used by causal_block_attention when `usable()` says so: CPU target, float32, head dims multiples
of 16, the kernels built, and no multi-device mesh active (an FFI call has no sharding rule; over
a mesh the XLA path keeps the partitioner's layout).

Letters: B batch, L positions, H query heads, G kv heads, P q/k head dim, O v head dim.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import jax.numpy as jnp

from c2jax.backends.cpu import kernels as cpu_kernels


def usable(q_BLHP, k_BLGP, v_BLGO) -> str | None:
    """Why the kernel cannot run these operands in the current trace (None when it can)."""
    if any(x.dtype != jnp.float32 for x in (q_BLHP, k_BLGP, v_BLGO)):
        return "operands are not float32"
    if q_BLHP.shape[-1] % 16 or v_BLGO.shape[-1] % 16:
        return "head dims must be multiples of 16"
    return cpu_kernels.unavailable()


def causal_attention(q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL, scale: float):
    """float32 [B, L, H, O]: softmax(scale q k^T, visible keys) v per query head (grouped kv heads)."""
    why = usable(q_BLHP, k_BLGP, v_BLGO)
    if why:
        raise RuntimeError(f"the CPU attention kernel cannot run: {why}")
    return _attention(q_BLHP, k_BLGP, v_BLGO, positions_BL.astype(jnp.int32), segment_ids_BL.astype(jnp.int32),
                      float(scale))


def _fwd_call(q, k, v, pos, seg, scale):
    B, L, H, _ = q.shape
    shapes = (jax.ShapeDtypeStruct((B, L, H, v.shape[-1]), jnp.float32), jax.ShapeDtypeStruct((B, L, H), jnp.float32))
    return jax.ffi.ffi_call(cpu_kernels.ATTENTION_FWD, shapes, vmap_method="sequential")(
        q, k, v, pos, seg, scale=np.float32(scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, pos, seg, scale):
    return _fwd_call(q, k, v, pos, seg, scale)[0]


def _attention_fwd(q, k, v, pos, seg, scale):
    out, lse = _fwd_call(q, k, v, pos, seg, scale)
    return out, (q, k, v, pos, seg, out, lse)


def _attention_bwd(scale, res, dout):
    q, k, v, pos, seg, out, lse = res
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    dq, dk, dv = jax.ffi.ffi_call(cpu_kernels.ATTENTION_BWD, shapes, vmap_method="sequential")(
        q, k, v, pos, seg, out, lse, dout.astype(jnp.float32), scale=np.float32(scale))
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
