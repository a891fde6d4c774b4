"""The token NLL op: per-token negative log-likelihood and logsumexp of float32 logits, as two
passes (forward; backward to the logits) that the fused output head (c2jax.train.head_loss) puts
around its matmuls. Chosen by `model.kernels.token_nll` ("auto" | name) for the traced target.

Each implementation is a `NllPasses` (the registry's `fn`):
  forward(logits_TV, targets_T) -> (nll_T, lse_T) float32
  backward(logits_TV, lse_T, targets_T, g_nll_T, g_lse_T, scale) -> float32 [T, V]
      = scale * ((g_nll + g_lse) softmax(logits) - g_nll onehot(target)), the gradient of
      logits = scale * x through (nll, lse).

The head's backward also chooses the precision its two products read that gradient in
(`model.kernels.head_grad`, HEAD_GRAD below): cast to the compute dtype, or kept in float32.

Letters: T tokens (any leading axes for xla), D model width, V vocab.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from c2jax.ops.registry import Impl, define_op, kernels_choice
from c2jax.ops.target import Target, current_target, one_cpu_device

TOKEN_NLL = define_op("token_nll", {"cpu": ("cpu_ffi", "xla"), "*": ("xla",)})


class NllPasses(NamedTuple):
    """An implementation's forward and backward passes (see the module note)."""

    forward: Callable
    backward: Callable


def xla_forward(logits_TV, targets_T):
    """(nll_T, lse_T) of float32 logits, over the last axis."""
    lse_T = jax.nn.logsumexp(logits_TV, axis=-1)
    return lse_T - jnp.take_along_axis(logits_TV, targets_T[..., None], axis=-1)[..., 0], lse_T


def xla_backward(logits_TV, lse_T, targets_T, g_nll_T, g_lse_T, scale: float = 1.0):
    """The logits' gradient in one elementwise pass (autodiff adds a zero-filled scatter for the
    target gather)."""
    hit = jax.lax.broadcasted_iota(jnp.int32, logits_TV.shape, logits_TV.ndim - 1) == targets_T[..., None]
    d_TV = (g_nll_T + g_lse_T)[..., None] * jnp.exp(logits_TV - lse_T[..., None]) - jnp.where(hit, g_nll_T[..., None], 0.0)
    return d_TV * scale if scale != 1.0 else d_TV


def _cpu_ffi_ok(target: Target, V: int, **spec) -> str | None:
    why = one_cpu_device(target)
    if why:
        return why
    from c2jax.backends.cpu import loss as cpu_loss
    return cpu_loss.usable(V)


def _cpu_forward(logits_TV, targets_T):
    from c2jax.backends.cpu import loss as cpu_loss
    return cpu_loss.token_nll_fwd(logits_TV, targets_T)


def _cpu_backward(logits_TV, lse_T, targets_T, g_nll_T, g_lse_T, scale: float = 1.0):
    from c2jax.backends.cpu import loss as cpu_loss
    return cpu_loss.token_nll_bwd(logits_TV, lse_T, targets_T, g_nll_T, g_lse_T, scale)


TOKEN_NLL.register("xla", doc="logsumexp and a take_along_axis; the gradient in one elementwise pass")(
    NllPasses(xla_forward, xla_backward))
TOKEN_NLL.register("cpu_ffi", _cpu_ffi_ok, doc="c2jax/backends/cpu/cpu_loss.cc: one vectorized pass per row each way")(
    NllPasses(_cpu_forward, _cpu_backward))


# The output head's backward: the operands of dh = d @ W^T and dW = h^T @ d, given the float32
# logits gradient d_TV, the hidden states h_TD and the head weight W in the compute dtype.
HEAD_GRAD = define_op("head_grad", {"tpu": ("float32",), "*": ("compute_dtype",)})


def compute_dtype_operands(d_TV, h_TD, w):
    """d cast to the compute dtype: the products run in it (a narrow copy of d beside the float32
    logits, which d cannot overwrite)."""
    return d_TV.astype(h_TD.dtype), h_TD, w


def float32_operands(d_TV, h_TD, w):
    """d kept in float32, h and W widened: d can overwrite the float32 logits it is computed from,
    and no narrow copy of the [T, V] gradient is made. On TPU the DEFAULT precision multiplies
    float32 operands in one bf16 pass, so the products cost what the compute-dtype ones do; on GPU
    they would run as TF32 (about half bf16's rate)."""
    f32 = jnp.float32
    return d_TV, h_TD.astype(f32), w.astype(f32)


HEAD_GRAD.register("compute_dtype", doc="the gradient cast to the compute dtype before the two products")(
    compute_dtype_operands)
HEAD_GRAD.register("float32", doc="the gradient kept in float32 over the logits' buffer; float32 products "
                   "(one bf16 pass on TPU)")(float32_operands)


def select(kernels, T: int, V: int) -> Impl:
    """The implementation (its fn an NllPasses) for [T, V] logits on the traced target, as the
    model config's `kernels` section (None: "auto") chooses; the choice is recorded."""
    return TOKEN_NLL.select(kernels_choice(kernels, "token_nll"), current_target(), T=T, V=V)


def select_head_grad(kernels) -> Impl:
    """The head backward's operand precision (its fn: (d_TV, h_TD, w) -> operands) for the traced
    target, as `kernels.head_grad` chooses; the choice is recorded."""
    return HEAD_GRAD.select(kernels_choice(kernels, "head_grad"), current_target())
