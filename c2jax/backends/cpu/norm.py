"""RMSNorm, alone or followed by the rotate-half RoPE rotation, for CPU training as XLA FFI calls
(cpu_norm.cc, built with c2jax.backends.cpu.kernels): one pass over each row forward and one back,
the weight's gradient summed in a fixed order.

Why: XLA CPU materializes the broadcast 1/rms as a full-size array between its reduction and the
product, and runs the rotation's two halves and their concatenation as separate loops; on the
89M train-step bench the norms and the q/k norm + RoPE took ~0.2 s of a ~2.9 s step.

Same arithmetic as c2jax.ops.layers.rms_norm and rotate (float32): y = w (x / rms(x)),
then with the rotation y1' = y1 cos - y2 sin, y2' = y2 cos + y1 sin over the halves of the last
dim. Used by layers.RMSNorm when `usable()` says so.

Letters: N rows, H heads (1 for a plain norm), P normalized dim, R = P / 2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.backends.cpu import kernels as cpu_kernels


def usable(x, weight, rope: bool = False) -> str | None:
    """Why the kernel cannot normalize x (by weight, then rotate when rope) in the current trace
    (None when it can)."""
    if x.dtype != jnp.float32 or weight.dtype != jnp.float32:
        return "operands are not float32"
    if x.ndim < 2 or x.size == 0:
        return "x must have rows"
    if x.shape[-1] % (32 if rope else 16):
        return f"the last dim must be a multiple of {32 if rope else 16}"
    return cpu_kernels.unavailable()


def rms_norm(x, weight, eps: float):
    """float32 like x: weight * x / rms(x) over the last dim."""
    _require(usable(x, weight))
    shape = x.shape
    return _norm(x.reshape(-1, 1, shape[-1]), weight, float(eps)).reshape(shape)


def rms_norm_rope(x_NHP, weight_P, cos_NR, sin_NR, eps: float):
    """float32 [..., H, P]: the per-head RMSNorm of x then the rotate-half rotation by cos / sin
    ([..., P/2], one row of tables per leading index, shared by the heads)."""
    _require(usable(x_NHP, weight_P, rope=True))
    shape = x_NHP.shape
    R = shape[-1] // 2
    n = int(np.prod(shape[:-2]))
    if cos_NR.shape[:-1] != shape[:-2] or cos_NR.shape[-1] != R or sin_NR.shape != cos_NR.shape:
        raise ValueError(f"rope tables {cos_NR.shape} / {sin_NR.shape} do not match x {shape}")
    y = _norm_rope(x_NHP.reshape(n, shape[-2], shape[-1]), weight_P,
                   cos_NR.astype(jnp.float32).reshape(n, R), sin_NR.astype(jnp.float32).reshape(n, R), float(eps))
    return y.reshape(shape)


def _require(why):
    if why:
        raise RuntimeError(f"the CPU norm kernel cannot run: {why}")


def _norm_fwd_call(x, w, eps):
    shapes = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape[:2], jnp.float32))
    return jax.ffi.ffi_call(cpu_kernels.RMS_NORM_FWD, shapes, vmap_method="sequential")(x, w, eps=np.float32(eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _norm(x, w, eps):
    return _norm_fwd_call(x, w, eps)[0]


def _norm_fwd(x, w, eps):
    y, r = _norm_fwd_call(x, w, eps)
    return y, (x, w, r)


def _norm_bwd(eps, res, dy):
    x, w, r = res
    shapes = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(w.shape, jnp.float32))
    dx, dw = jax.ffi.ffi_call(cpu_kernels.RMS_NORM_BWD, shapes, vmap_method="sequential")(
        x, w, r, dy.astype(jnp.float32))
    return dx, dw


_norm.defvjp(_norm_fwd, _norm_bwd)


def _rope_fwd_call(x, w, cos, sin, eps):
    shapes = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape[:2], jnp.float32))
    return jax.ffi.ffi_call(cpu_kernels.NORM_ROPE_FWD, shapes, vmap_method="sequential")(
        x, w, cos, sin, eps=np.float32(eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_rope(x, w, cos, sin, eps):
    return _rope_fwd_call(x, w, cos, sin, eps)[0]


def _norm_rope_fwd(x, w, cos, sin, eps):
    y, r = _rope_fwd_call(x, w, cos, sin, eps)
    return y, (x, w, r, cos, sin)


def _norm_rope_bwd(eps, res, dy):
    x, w, r, cos, sin = res
    shapes = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(w.shape, jnp.float32))
    dx, dw = jax.ffi.ffi_call(cpu_kernels.NORM_ROPE_BWD, shapes, vmap_method="sequential")(
        x, w, r, cos, sin, dy.astype(jnp.float32))
    # the tables come from positions (integers): no gradient flows to them
    return dx, dw, jnp.zeros_like(cos), jnp.zeros_like(sin)


_norm_rope.defvjp(_norm_rope_fwd, _norm_rope_bwd)
