"""The output head fused with the per-token NLL: logits = scale * h @ W, then NLL and logsumexp,
with a hand-written backward.

Why: through autodiff of `einsum` + `token_nll`, XLA CPU writes the [T, V] logits gradient out
transposed for the weight gradient (a strided copy as slow as the head's matmuls on the 89M
bench shape); here dW = h^T @ dlogits reads dlogits in place. Same values and gradients as
`token_nll(scale * h @ W)` (tests/train/test_head_loss.py).

Letters: T tokens, D model width, V vocab.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.backends.cpu import kernels as cpu_kernels


def head_token_nll(h_TD, w, targets_T, *, scale: float = 1.0, tied: bool = False):
    """(nll_T, lse_T) float32 of logits = scale * h_TD @ W, W = w [D, V] (or w.T for a tied
    embedding w [V, D]); h and W are multiplied in h's dtype with float32 accumulation."""
    return _head_nll(h_TD, w.astype(h_TD.dtype), targets_T, float(scale), bool(tied))


def _logits(h_TD, w, scale, tied):
    dims = (((1,), (1,)), ((), ())) if tied else (((1,), (0,)), ((), ()))
    logits_TV = jax.lax.dot_general(h_TD, w, dims, preferred_element_type=jnp.float32)
    return logits_TV * scale if scale != 1.0 else logits_TV


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head_nll(h_TD, w, targets_T, scale, tied):
    return _head_nll_fwd(h_TD, w, targets_T, scale, tied)[0]


def _head_nll_fwd(h_TD, w, targets_T, scale, tied):
    logits_TV = _logits(h_TD, w, scale, tied)
    if _cpu_kernel_usable(logits_TV) is None:
        shapes = (jax.ShapeDtypeStruct(targets_T.shape, jnp.float32),) * 2
        nll_T, lse_T = jax.ffi.ffi_call(cpu_kernels.TOKEN_NLL_FWD, shapes, vmap_method="sequential")(
            logits_TV, targets_T.astype(jnp.int32))
    else:
        lse_T = jax.nn.logsumexp(logits_TV, axis=-1)
        nll_T = lse_T - jnp.take_along_axis(logits_TV, targets_T[:, None], axis=-1)[:, 0]
    return (nll_T, lse_T), (h_TD, w, targets_T, logits_TV, lse_T)


def _cpu_kernel_usable(logits_TV) -> str | None:
    """Why the logsumexp / NLL passes cannot run as cpu_loss.cc's FFI calls (None when they can):
    XLA CPU runs these row reductions and exps over the [T, V] logits at a fraction of the
    vector rate (89M bench: ~80 ms of a ~145 ms head product in the forward)."""
    if logits_TV.ndim != 2 or logits_TV.shape[-1] % 16:
        return "vocab must be a multiple of 16"
    return cpu_kernels.training_unavailable()


def _head_nll_bwd(scale, tied, res, cts):
    h_TD, w, targets_T, logits_TV, lse_T = res
    g_nll, g_lse = cts
    if _cpu_kernel_usable(logits_TV) is None:
        d_TV = jax.ffi.ffi_call(cpu_kernels.TOKEN_NLL_BWD, jax.ShapeDtypeStruct(logits_TV.shape, jnp.float32),
                                vmap_method="sequential")(
            logits_TV, lse_T, targets_T.astype(jnp.int32), g_nll.astype(jnp.float32), g_lse.astype(jnp.float32),
            scale=np.float32(scale))
    else:
        hit = jax.lax.broadcasted_iota(jnp.int32, logits_TV.shape, 1) == targets_T[:, None]
        d_TV = (g_nll + g_lse)[:, None] * jnp.exp(logits_TV - lse_T[:, None]) - jnp.where(hit, g_nll[:, None], 0.0)
        if scale != 1.0:
            d_TV = d_TV * scale
    d_TV = d_TV.astype(h_TD.dtype)
    f32 = jnp.float32
    if tied:   # W = w.T: dh = d @ w, dw = d.T @ h
        dh = jax.lax.dot_general(d_TV, w, (((1,), (0,)), ((), ())), preferred_element_type=f32)
        dw = jax.lax.dot_general(d_TV, h_TD, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    else:      # dh = d @ w.T, dw = h.T @ d
        dh = jax.lax.dot_general(d_TV, w, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        dw = jax.lax.dot_general(h_TD, d_TV, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return dh.astype(h_TD.dtype), dw.astype(w.dtype), None


_head_nll.defvjp(_head_nll_fwd, _head_nll_bwd)
