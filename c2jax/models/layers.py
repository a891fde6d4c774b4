"""Basic layers: linear with logical axes, RMSNorm, SwiGLU MLP, RoPE (default and YaRN).

Letters: B batch, L length, D model width, F MLP width, H heads, R rotary dims.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from c2jax.ops import layers as ops_layers
from c2jax.ops import remat
from c2jax.ops import weights
from c2jax.ops.layers import rotate

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    """Map a config dtype name to a jnp dtype."""
    return DTYPES[name]


def kernels_of(m):
    """Model config m's `kernels` section (c2jax.ops' choice per op; None: every op "auto")."""
    return m.get("kernels") if hasattr(m, "get") else getattr(m, "kernels", None)


class Linear(nn.Module):
    """y = x @ W (+ b) with W of shape (in, out) annotated with logical axis names."""

    features: int
    axes: tuple[str | None, str | None]
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02
    kernels: object = None   # the model config's `kernels` section (c2jax.ops chooses the matmul)

    @nn.compact
    def __call__(self, x):
        w, b = _linear_params(self, x.shape[-1])
        return ops_layers.matmuls(self.kernels, x, [(w, b)], self.dtype)[0]


class LinearWeights(Linear):
    """A Linear's (kernel, bias or None) under the same names, init and axes, without the
    product: for a caller that runs several projections of one input as one (fused_linears)."""

    @nn.compact
    def __call__(self, in_features: int):
        return _linear_params(self, in_features)


def _linear_params(mod, in_features: int):
    # the float kernel, or the layout the sampler stored for it (pre-quantized, packed: c2jax.ops.weights)
    kernel = weights.weight(mod, "kernel", nn.initializers.normal(mod.init_std), mod.axes,
                            (in_features, mod.features), mod.param_dtype)
    bias = None
    if mod.use_bias:
        bias = mod.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, mod.axes[1:]),
                         (mod.features,), mod.param_dtype)
    return kernel, bias


def fused_linears(x, weights, dtype, kernels=None):
    """[x @ W_i (+ b_i)] for LinearWeights' (W_i, b_i): several projections of one input, which
    the matmul op may run as one product (c2jax.ops.layers)."""
    return ops_layers.matmuls(kernels, x, weights, dtype)


class RMSNorm(nn.Module):
    """RMSNorm in float32, weight applied after casting back (as in HF Llama-family models)."""

    eps: float = 1e-6
    axis_name: str | None = "embed"
    param_dtype: jnp.dtype = jnp.float32
    kernels: object = None   # the model config's `kernels` section (c2jax.ops chooses the norm)

    @nn.compact
    def __call__(self, x, rope=None):
        """The norm of x over its last dim; with rope=(cos, sin) (rope_tables'), then the
        rotate-half rotation of that dim (Qwen3's q/k norm then RoPE, one op)."""
        weight = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                            (x.shape[-1],), self.param_dtype)
        return ops_layers.norm(self.kernels, x, weight, float(self.eps), rope)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    width: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02
    kernels: object = None

    @nn.compact
    def __call__(self, x_BLD):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, init_std=self.init_std, kernels=self.kernels)
        gate_BLF = remat.tag(Linear(self.width, ("embed", "mlp"), name="gate", **kw)(x_BLD), remat.MLP_IN)
        up_BLF = remat.tag(Linear(self.width, ("embed", "mlp"), name="up", **kw)(x_BLD), remat.MLP_IN)
        h_BLF = nn.with_logical_constraint(nn.silu(gate_BLF) * up_BLF, ("batch", "length", "mlp"))
        return remat.tag(Linear(x_BLD.shape[-1], ("mlp", "embed"), name="down", **kw)(h_BLF), remat.MLP_OUT)


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
