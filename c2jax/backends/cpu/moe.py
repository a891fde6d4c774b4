"""Routed experts (SwiGLU) for CPU training and prefill as two XLA FFI calls (cpu_moe.cc, built
with c2jax.backends.cpu.kernels), with ops.experts_xla.capacity_dispatch's semantics: each expert takes its
first `cap` assignments in token order.

Why: XLA CPU's block path (c2jax.ops.experts_xla.block_dispatch) pads each expert's rows to blocks, loops over
them with dynamic slices and update-slices, and zero-fills and gathers [R, D] / [R, F] buffers
around its products; on the 89M bench shape that is ~40% of an MoE layer's time on top of
the products. The kernel runs each expert's rows in chunks of 128 through register-blocked
products with no padding beyond 4 rows, and keeps per-assignment residuals (gate and up
pre-activations and the expert's output row, in expert-sorted order, written by the products in
place) for a backward that produces dx, d weights and
the three expert weight gradients in one call.

Used by capacity_dispatch when `usable()` says so: CPU target, float32 activations and expert
weights, width and expert width multiples of 64, the kernels built, no multi-device mesh.

Letters: T tokens, K experts per token, A = T K assignments, E experts, D width, F expert width.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.backends.cpu import kernels as cpu_kernels
if TYPE_CHECKING:   # the view the kernels read (c2jax.ops.stacked, a layer above; only its fields are used)
    from c2jax.ops.stacked import LayerExperts


def usable_operands(x_dtype, w_dtype, D: int, F: int) -> str | None:
    """Why the kernel cannot run operands of these dtypes and widths (None when it can)."""
    if w_dtype != jnp.float32 or x_dtype != jnp.float32:
        return "activations or expert weights are not float32"
    if D % 64 or F % 64:
        return "width and expert width must be multiples of 64"
    return cpu_kernels.unavailable()


def usable(x_TD, w_gate_EDF) -> str | None:
    """Why the kernel cannot run these operands (None when it can)."""
    return usable_operands(x_TD.dtype, getattr(w_gate_EDF, "dtype", None), x_TD.shape[-1], w_gate_EDF.shape[-1])


def expert_ffn(x_TD, ids_TK, weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD, cap: int,
               stacked: LayerExperts | None = None):
    """float32 [T, D]: sum_k weights[t, k] * SwiGLU_{ids[t, k]}(x[t]) over the kept assignments
    (each expert's first `cap` in token order; ids outside [0, E) add nothing).

    stacked: the same weights as a layer of the stacks they were sliced from; the kernels then
    read the stacks and the per-layer weights only carry the gradients (their values are unused)."""
    why = usable(x_TD, w_gate_EDF)
    if why:
        raise RuntimeError(f"the CPU expert kernel cannot run: {why}")
    if stacked is None:
        stacks = (w_gate_EDF[None], w_up_EDF[None], w_down_EFD[None])
        layer = jnp.zeros((), jnp.int32)
    else:
        stacks = (stacked.w_gate_NEDF, stacked.w_up_NEDF, stacked.w_down_NEFD)
        layer = jnp.asarray(stacked.layer, jnp.int32).reshape(())
        for s, w in zip(stacks, (w_gate_EDF, w_up_EDF, w_down_EFD)):
            if s.shape[1:] != w.shape or s.dtype != w.dtype:
                raise ValueError(f"stacked expert weights {s.shape} {s.dtype} do not hold layers of "
                                 f"{w.shape} {w.dtype}")
    stacks = tuple(jax.lax.stop_gradient(s) for s in stacks)
    return _ffn(x_TD, ids_TK.astype(jnp.int32), weights_TK.astype(jnp.float32), w_gate_EDF, w_up_EDF, w_down_EFD,
                *stacks, layer, int(cap))


def _fwd_call(x, ids, weights, sg, su, sd, layer, cap):
    T, D = x.shape
    A, F = ids.size, sg.shape[-1]
    f32 = jnp.float32
    shapes = (jax.ShapeDtypeStruct((T, D), f32), jax.ShapeDtypeStruct((A, 2 * F), f32),
              jax.ShapeDtypeStruct((A, D), f32))
    return jax.ffi.ffi_call(cpu_kernels.EXPERT_FWD, shapes, vmap_method="sequential")(
        x, ids, weights, sg, su, sd, layer, cap=np.int64(cap))


# wg, wu, wd: the differentiable per-layer weights, never read (the kernels read sg, su, sd at layer)
@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _ffn(x, ids, weights, wg, wu, wd, sg, su, sd, layer, cap):
    return _fwd_call(x, ids, weights, sg, su, sd, layer, cap)[0]


def _ffn_fwd(x, ids, weights, wg, wu, wd, sg, su, sd, layer, cap):
    out, gu, y = _fwd_call(x, ids, weights, sg, su, sd, layer, cap)
    return out, (x, ids, weights, sg, su, sd, layer, gu, y)


def _ffn_bwd(cap, res, dout):
    x, ids, weights, sg, su, sd, layer, gu, y = res
    f32 = jnp.float32
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, f32) for a in (x, weights)) + tuple(
        jax.ShapeDtypeStruct(a.shape[1:], f32) for a in (sg, su, sd))
    dx, dweights, dwg, dwu, dwd = jax.ffi.ffi_call(cpu_kernels.EXPERT_BWD, shapes, vmap_method="sequential")(
        x, ids, weights, sg, su, sd, layer, gu, y, dout.astype(f32), cap=np.int64(cap))
    return dx, None, dweights, dwg, dwu, dwd, None, None, None, None


_ffn.defvjp(_ffn_fwd, _ffn_bwd)
