"""The token NLL op: per-token negative log-likelihood and logsumexp of float32 logits, as two
passes (forward; backward to the logits) that the fused output head (c2jax.train.head_loss) puts
around its matmuls. Chosen by `model.kernels.token_nll` ("auto" | name) for the traced target.

Each implementation is a `NllPasses` (the registry's `fn`):
  forward(logits_TV, targets_T) -> (nll_T, lse_T) float32
  backward(logits_TV, lse_T, targets_T, g_nll_T, g_lse_T, scale) -> float32 [T, V]
      = scale * ((g_nll + g_lse) softmax(logits) - g_nll onehot(target)), the gradient of
      logits = scale * x through (nll, lse).

Letters: T tokens (any leading axes for xla), V vocab.
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


def select(kernels, T: int, V: int) -> Impl:
    """The implementation (its fn an NllPasses) for [T, V] logits on the traced target, as the
    model config's `kernels` section (None: "auto") chooses; the choice is recorded."""
    return TOKEN_NLL.select(kernels_choice(kernels, "token_nll"), current_target(), T=T, V=V)
