"""Ops of the dense layers: `matmul` (x @ W for one or several projections of one input) and
`norm` (RMSNorm, optionally fused with the RoPE rotation).

Letters: D input width, F output width, r rotary half-width.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from c2jax.ops.registry import define_op, kernels_choice
from c2jax.ops.target import Target, current_target, one_cpu_device

# weights the sampler prepared for decode (c2jax.sampling: pre-quantized, or packed for the CPU
# kernel) take the implementation that reads that layout
MATMUL = define_op("matmul", {"cpu": ("cpu_packed", "qmatmul", "xla_cpu", "xla"), "*": ("qmatmul", "xla")})
NORM = define_op("norm", {"cpu": ("cpu_ffi", "xla"), "*": ("xla",)})


# ----------------------------------------------------------------------------- matmul


def _layout(w) -> str:
    """"plain", "quantized" (pallas_kernels.QuantizedWeight) or "packed" (backends.cpu PackedMatrix)."""
    return "quantized" if hasattr(w, "values_KN") else "plain" if hasattr(w, "ndim") else "packed"


def _plain(target: Target, **spec):
    return None if spec.get("layout", "plain") == "plain" else f"weights are {spec['layout']} (a decode layout)"


def _plain_on_one_cpu(target: Target, **spec):
    return _plain(target, **spec) or one_cpu_device(target)


@MATMUL.register("cpu_packed", lambda target, **spec: None if spec["layout"] == "packed" else "weights are not packed",
                 doc="c2jax/backends/cpu/cpu_kernels.cc on weights the sampler packed into panels")
def _matmul_packed(x, weights, dtype):
    from c2jax.backends.cpu import kernels as cpu_kernels
    x2 = x.reshape(-1, x.shape[-1])
    return [_biased(cpu_kernels.matmul(x2, w).reshape(*x.shape[:-1], -1).astype(dtype), b, dtype) for w, b in weights]


def _qmatmul_ok(target: Target, **spec):
    return None if spec["layout"] == "quantized" else "weights are not pre-quantized"


@MATMUL.register("qmatmul", _qmatmul_ok, doc="pallas_kernels.qmatmul, weight-only (1-byte values + scales read)")
def _matmul_quantized(x, weights, dtype):
    import pallas_kernels
    impl = "pallas" if current_target().platform == "tpu" else "xla"
    out = []
    for w, b in weights:
        y = pallas_kernels.qmatmul(x.reshape(-1, x.shape[-1]).astype(dtype), w, mode="weight_only", impl=impl)
        out.append(_biased(y.reshape(*x.shape[:-1], y.shape[-1]).astype(dtype), b, dtype))
    return out


@MATMUL.register("xla", _plain, doc="einsum per projection; autodiff's backward")
def _matmul_xla(x, weights, dtype):
    return [_biased(jnp.einsum("...d,df->...f", x.astype(dtype), w.astype(dtype)), b, dtype) for w, b in weights]


@MATMUL.register("xla_cpu", _plain_on_one_cpu,
                 doc="several projections of one input as one product, with a written-out backward")
def _matmul_cpu(x, weights, dtype):
    if len(weights) == 1:
        w, b = weights[0]
        return [_biased(cpu_product(x.astype(dtype), w.astype(dtype)), b, dtype)]
    y = cpu_product(x.astype(dtype), jnp.concatenate([w.astype(dtype) for w, _ in weights], axis=1))
    if any(b is not None for _, b in weights):
        y = y + jnp.concatenate([jnp.zeros(w.shape[1], dtype) if b is None else b.astype(dtype) for w, b in weights])
    ends = list(itertools.accumulate(w.shape[1] for w, _ in weights))
    return [y[..., e - w.shape[1]:e] for e, (w, _) in zip(ends, weights)]


def _biased(y, b, dtype):
    return y if b is None else y + b.astype(dtype)


def matmuls(kernels, x, weights, dtype):
    """[x @ W_i (+ b_i)] in `dtype` for weights [(W_i [D, F_i], b_i or None)]."""
    kinds = {_layout(w) for w, _ in weights}
    if len(kinds) > 1:   # the sampler packed some of these projections only: one call each
        return [matmuls(kernels, x, [wb], dtype)[0] for wb in weights]
    impl = MATMUL.select(kernels_choice(kernels, "matmul"), current_target(), layout=kinds.pop())
    return impl.fn(x, weights, dtype)


@jax.custom_vjp
def cpu_product(x, kernel):
    """x @ kernel (any leading dims on x) with a written-out backward for XLA CPU: autodiff's
    weight gradient made XLA copy the output gradient transposed ([N, T], ~8 MB a projection on
    the 89M bench) before each product; contracting both operands over their rows needs no copy
    (~50 ms of a 2.4 s step)."""
    return jnp.einsum("...d,df->...f", x, kernel)


def _cpu_product_fwd(x, kernel):
    return cpu_product(x, kernel), (x, kernel)


def _cpu_product_bwd(res, dy):
    x, kernel = res
    dx = jnp.einsum("...f,df->...d", dy, kernel)
    dw = jnp.einsum("td,tf->df", x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]))
    return dx, dw


cpu_product.defvjp(_cpu_product_fwd, _cpu_product_bwd)


# ----------------------------------------------------------------------------- norm


def _cpu_norm_ok(target: Target, **spec):
    why = one_cpu_device(target)
    if why:
        return why
    from c2jax.backends.cpu import norm as cpu_norm
    x, w = spec["x"], spec["weight"]
    if spec["rope"] and x.ndim != 4:
        return "the fused norm + RoPE takes [B, L, H, P] rows"
    return cpu_norm.usable(x, w, rope=spec["rope"])


@NORM.register("xla", doc="float32 RMSNorm with a written-out backward; RoPE as its own pass")
def _norm_xla(x, weight, eps, rope):
    if rope is None:
        return rms_norm(x, weight, eps)
    return rotate(rms_norm(x, weight, eps), *rope)


@NORM.register("cpu_ffi", _cpu_norm_ok, doc="c2jax/backends/cpu/cpu_norm.cc: one pass per row, norm + RoPE fused")
def _norm_cpu(x, weight, eps, rope):
    from c2jax.backends.cpu import norm as cpu_norm
    if rope is None:
        return cpu_norm.rms_norm(x, weight, eps)
    return cpu_norm.rms_norm_rope(x, weight, *rope, eps)


def norm(kernels, x, weight, eps: float, rope=None):
    """weight * x / rms(x) over the last dim; with rope=(cos, sin) then the rotate-half rotation."""
    impl = NORM.select(kernels_choice(kernels, "norm"), current_target(), x=x, weight=weight, rope=rope is not None)
    return impl.fn(x, weight, eps, rope)


# The backward is written out in float32 from the saved 1/rms; on the 89M CPU bench it took the
# train step from ~3.6 to ~3.5 s against autodiff's.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, weight, eps: float):
    """weight * x / rms(x) over the last dim, computed in float32, returned in x's dtype."""
    return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * (x32 * r).astype(x.dtype), (x, weight, r)


def _rms_norm_bwd(eps, res, dy):
    x, weight, r = res
    xhat = x.astype(jnp.float32) * r
    dy32 = dy.astype(jnp.float32)
    wdy = dy32 * weight.astype(jnp.float32)
    dx = r * (wdy - xhat * jnp.mean(wdy * xhat, axis=-1, keepdims=True))
    dw = jnp.sum((dy32 * xhat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rotate(x_BLHR, cos_BLr, sin_BLr, interleave: bool = False):
    """The RoPE rotation of x's last dim by (cos, sin) tables [B, L, R/2] (shared by the heads)."""
    return _rotate(x_BLHR.astype(jnp.float32), cos_BLr[:, :, None, :], sin_BLr[:, :, None, :],
                   interleave).astype(x_BLHR.dtype)


def _rotate_pairs(x, cos, sin, interleave):
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# The backward is the transposed rotation, written out: autodiff of the slices and concatenate
# made XLA CPU spend ~2x as long on q-norm + RoPE fwd+bwd (18 vs 9 ms at the 89M bench shape).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotate(x, cos, sin, interleave):
    return _rotate_pairs(x, cos, sin, interleave)


def _rotate_fwd(x, cos, sin, interleave):
    return _rotate_pairs(x, cos, sin, interleave), (cos, sin)


def _rotate_bwd(interleave, res, dy):
    cos, sin = res
    half = dy.shape[-1] // 2
    d1, d2 = dy[..., :half], dy[..., half:]
    dx1, dx2 = d1 * cos + d2 * sin, d2 * cos - d1 * sin
    if interleave:
        dx = jnp.stack([dx1, dx2], axis=-1).reshape(dy.shape)
    else:
        dx = jnp.concatenate([dx1, dx2], axis=-1)
    return dx, None, None


_rotate.defvjp(_rotate_fwd, _rotate_bwd)
