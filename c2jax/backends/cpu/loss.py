"""The per-token NLL passes over materialized [T, V] float32 logits as XLA FFI calls
(c2jax/backends/cpu/cpu_loss.cc): logsumexp and the target's logit in one vectorized pass per row,
and the logits' gradient in one more. The cpu_ffi implementation of c2jax.ops.token_nll.

Why: XLA CPU runs these row reductions and exps over the [T, V] logits at a fraction of the
vector rate (89M bench: ~80 ms of a ~145 ms head product in the forward).

Letters: T tokens, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.backends.cpu import kernels as cpu_kernels

LANES = 16   # the kernel's row width unit (cpu_loss.cc works on 16 floats at a time)


def usable(V: int) -> str | None:
    """Why the kernels cannot run a [T, V] logits matrix in this process (None when they can)."""
    if V % LANES:
        return f"the vocab must be a multiple of {LANES} (got {V})"
    return cpu_kernels.unavailable()


def token_nll_fwd(logits_TV, targets_T):
    """(nll_T, lse_T) float32 of float32 logits_TV: logsumexp - the target's logit, and logsumexp."""
    shapes = (jax.ShapeDtypeStruct(targets_T.shape, jnp.float32),) * 2
    return jax.ffi.ffi_call(cpu_kernels.TOKEN_NLL_FWD, shapes, vmap_method="sequential")(
        logits_TV.astype(jnp.float32), targets_T.astype(jnp.int32))


def token_nll_bwd(logits_TV, lse_T, targets_T, g_nll_T, g_lse_T, scale: float = 1.0):
    """float32 [T, V]: scale * ((g_nll + g_lse) softmax(logits) - g_nll onehot(target)), the
    gradient of logits = scale * x through (nll, lse) with cotangents (g_nll, g_lse)."""
    return jax.ffi.ffi_call(cpu_kernels.TOKEN_NLL_BWD, jax.ShapeDtypeStruct(logits_TV.shape, jnp.float32),
                            vmap_method="sequential")(
        logits_TV.astype(jnp.float32), lse_T.astype(jnp.float32), targets_T.astype(jnp.int32),
        g_nll_T.astype(jnp.float32), g_lse_T.astype(jnp.float32), scale=np.float32(scale))
