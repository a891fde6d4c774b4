"""Basic layers: linear with logical axes, RMSNorm, SwiGLU MLP, RoPE (default and YaRN).

Letters: B batch, L length, D model width, F MLP width, H heads, R rotary dims.
"""
from __future__ import annotations

import functools
import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.backends.cpu import norm as cpu_norm
from c2jax.platform import target_backend

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    """Map a config dtype name to a jnp dtype."""
    return DTYPES[name]


class Linear(nn.Module):
    """y = x @ W (+ b) with W of shape (in, out) annotated with logical axis names."""

    features: int
    axes: tuple[str | None, str | None]
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x):
        w, b = _linear_params(self, x.shape[-1])
        return _biased(_project(x, w, self.dtype), b, self.dtype)


class LinearWeights(Linear):
    """A Linear's (kernel, bias or None) under the same names, init and axes, without the
    product: for a caller that runs several projections of one input as one (fused_linears)."""

    @nn.compact
    def __call__(self, in_features: int):
        return _linear_params(self, in_features)


def _linear_params(mod, in_features: int):
    pre = mod.get_variable("params", "kernel") if mod.has_variable("params", "kernel") else None
    if not _prepared(pre):
        pre = mod.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(mod.init_std), mod.axes),
                        (in_features, mod.features), mod.param_dtype)
    bias = None
    if mod.use_bias:
        bias = mod.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, mod.axes[1:]),
                         (mod.features,), mod.param_dtype)
    return pre, bias


def _prepared(w) -> bool:
    """A weight pre-quantized (c2jax.sampling.quantized) or packed for the CPU decode kernel."""
    return hasattr(w, "values_KN") or isinstance(w, cpu_kernels.PackedMatrix)


def _project(x, w, dtype):
    if hasattr(w, "values_KN"):
        return quantized_matmul(x.astype(dtype), w).astype(dtype)
    if isinstance(w, cpu_kernels.PackedMatrix):
        return cpu_kernels.matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1).astype(dtype)
    x_, k_ = x.astype(dtype), w.astype(dtype)
    return cpu_product(x_, k_) if target_backend() == "cpu" else jnp.einsum("...d,df->...f", x_, k_)


def _biased(y, b, dtype):
    return y if b is None else y + b.astype(dtype)


def fused_linears(x, weights, dtype):
    """[x @ W_i (+ b_i)] for LinearWeights' (W_i, b_i). On a single CPU device, one product over
    the kernels side by side: XLA CPU ran the three attention projections' forward and backward
    ~25% slower as three products, and summed their input gradients in extra passes."""
    from c2jax.parallel.mesh import active_axis_sizes
    if (target_backend() != "cpu" or math.prod(active_axis_sizes().values()) > 1
            or any(_prepared(w) for w, _ in weights)):
        return [_biased(_project(x, w, dtype), b, dtype) for w, b in weights]
    y = cpu_product(x.astype(dtype), jnp.concatenate([w.astype(dtype) for w, _ in weights], axis=1))
    if any(b is not None for _, b in weights):
        y = y + jnp.concatenate([jnp.zeros(w.shape[1], dtype) if b is None else b.astype(dtype) for w, b in weights])
    ends = list(itertools.accumulate(w.shape[1] for w, _ in weights))
    return [y[..., e - w.shape[1]:e] for e, (w, _) in zip(ends, weights)]


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


def quantized_matmul(x_LK, w):
    """x @ w for a pallas_kernels.QuantizedWeight w [K, N] (weight-only: the weight's 1-byte values
    and scales are read, activations stay in bf16); any leading dims on x."""
    import pallas_kernels  # dispatcher; the model never calls a backend kernel directly
    y = pallas_kernels.qmatmul(x_LK.reshape(-1, x_LK.shape[-1]), w, mode="weight_only")
    return y.reshape(*x_LK.shape[:-1], y.shape[-1])


class RMSNorm(nn.Module):
    """RMSNorm in float32, weight applied after casting back (as in HF Llama-family models)."""

    eps: float = 1e-6
    axis_name: str | None = "embed"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, rope=None):
        """The norm of x over its last dim; with rope=(cos, sin) (rope_tables'), then the
        rotate-half rotation of that dim (Qwen3's q/k norm then RoPE, fused on CPU)."""
        weight = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                            (x.shape[-1],), self.param_dtype)
        eps = float(self.eps)
        if rope is None:
            if cpu_norm.usable(x, weight) is None:
                return cpu_norm.rms_norm(x, weight, eps)
            return rms_norm(x, weight, eps)
        cos, sin = rope
        if x.ndim == 4 and cpu_norm.usable(x, weight, rope=True) is None:
            return cpu_norm.rms_norm_rope(x, weight, cos, sin, eps)
        return rotate(rms_norm(x, weight, eps), cos, sin)


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


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    width: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x_BLD):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, init_std=self.init_std)
        gate_BLF = Linear(self.width, ("embed", "mlp"), name="gate", **kw)(x_BLD)
        up_BLF = Linear(self.width, ("embed", "mlp"), name="up", **kw)(x_BLD)
        h_BLF = nn.with_logical_constraint(nn.silu(gate_BLF) * up_BLF, ("batch", "length", "mlp"))
        return Linear(x_BLD.shape[-1], ("mlp", "embed"), name="down", **kw)(h_BLF)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, m) -> tuple[jnp.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin attention factor for model config m."""
    exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    pos_freqs = m.rope_theta ** exponent
    if m.rope_scaling == "none":
        return 1.0 / pos_freqs, 1.0
    factor = m.yarn_factor
    if m.yarn_mscale and m.yarn_mscale_all_dim:
        attention_factor = _yarn_mscale(factor, m.yarn_mscale) / _yarn_mscale(factor, m.yarn_mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations):
        return (dim * math.log(m.yarn_original_max_position / (num_rotations * 2 * math.pi))) / (
            2 * math.log(m.rope_theta))

    low = max(math.floor(correction_dim(m.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(m.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1.0 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(head_dim: int, m) -> float:
    """1/sqrt(head_dim), times YaRN's mscale^2 when mscale_all_dim is set (DeepSeek MLA)."""
    scale = head_dim ** -0.5
    if m.rope_scaling == "yarn" and m.yarn_mscale_all_dim:
        ms = _yarn_mscale(m.yarn_factor, m.yarn_mscale_all_dim)
        scale = scale * ms * ms
    return scale


def apply_rope(x_BLHR, positions_BL, inv_freq, attention_factor: float, interleave: bool):
    """Rotate the last dim of x by position. interleave=True rotates pairs (x0,x1),(x2,x3),...
    and returns them de-interleaved (HF DeepSeek-V3 layout); otherwise rotate_half pairs."""
    return rotate(x_BLHR, *rope_tables(positions_BL, inv_freq, attention_factor), interleave)


def rope_tables(positions_BL, inv_freq, attention_factor: float):
    """(cos, sin) float32 [B, L, R/2] of the rotation by position, scaled by the attention factor."""
    freqs_BLr = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(freqs_BLr) * attention_factor, jnp.sin(freqs_BLr) * attention_factor


def rotate(x_BLHR, cos_BLr, sin_BLr, interleave: bool = False):
    """The RoPE rotation of x's last dim by rope_tables' cos / sin (shared by the heads)."""
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
