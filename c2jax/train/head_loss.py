"""The output head fused with the per-token NLL: logits = scale * h @ W, then NLL and logsumexp,
with a hand-written backward.

Why: through autodiff of `einsum` + `token_nll`, XLA CPU writes the [T, V] logits gradient out
transposed for the weight gradient (a strided copy as slow as the head's matmuls on the 89M
bench shape); here dW = h^T @ dlogits reads dlogits in place. Same values and gradients as
`token_nll(scale * h @ W)` (tests/train/test_head_loss.py). The NLL passes between the matmuls are
the token_nll op's (c2jax.ops.token_nll: XLA, or cpu_loss.cc's FFI calls on CPU), chosen by
`model.kernels.token_nll`; the precision of the gradient the backward's two products read by
`model.kernels.head_grad` (c2jax.ops.token_nll.HEAD_GRAD).

Letters: T tokens, D model width, V vocab.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from c2jax.ops import token_nll as token_nll_op


def head_token_nll(h_TD, w, targets_T, *, scale: float = 1.0, tied: bool = False, kernels=None):
    """(nll_T, lse_T) float32 of logits = scale * h_TD @ W, W = w [D, V] (or w.T for a tied
    embedding w [V, D]); h and W are multiplied in h's dtype with float32 accumulation. kernels:
    the model config's `kernels` section (its token_nll choice; None = "auto")."""
    V = w.shape[0] if tied else w.shape[1]
    impl = token_nll_op.select(kernels, T=h_TD.shape[0], V=V)
    grad = token_nll_op.select_head_grad(kernels)
    return _head_nll(h_TD, w.astype(h_TD.dtype), targets_T, float(scale), bool(tied), impl.name, grad.name)


def _logits(h_TD, w, scale, tied):
    dims = (((1,), (1,)), ((), ())) if tied else (((1,), (0,)), ((), ()))
    logits_TV = jax.lax.dot_general(h_TD, w, dims, preferred_element_type=jnp.float32)
    return logits_TV * scale if scale != 1.0 else logits_TV


def _passes(impl: str) -> token_nll_op.NllPasses:
    return token_nll_op.TOKEN_NLL.impls[impl].fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _head_nll(h_TD, w, targets_T, scale, tied, impl, grad):
    return _head_nll_fwd(h_TD, w, targets_T, scale, tied, impl, grad)[0]


def _head_nll_fwd(h_TD, w, targets_T, scale, tied, impl, grad):
    logits_TV = _logits(h_TD, w, scale, tied)
    nll_T, lse_T = _passes(impl).forward(logits_TV, targets_T)
    return (nll_T, lse_T), (h_TD, w, targets_T, logits_TV, lse_T)


def _head_nll_bwd(scale, tied, impl, grad, res, cts):
    h_TD, w, targets_T, logits_TV, lse_T = res
    g_nll, g_lse = cts
    d_TV = _passes(impl).backward(logits_TV, lse_T, targets_T, g_nll.astype(jnp.float32),
                                  g_lse.astype(jnp.float32), scale)
    d_op, h_op, w_op = token_nll_op.HEAD_GRAD.impls[grad].fn(d_TV, h_TD, w)
    f32 = jnp.float32
    if tied:   # W = w.T: dh = d @ w, dw = d.T @ h
        dh = jax.lax.dot_general(d_op, w_op, (((1,), (0,)), ((), ())), preferred_element_type=f32)
        dw = jax.lax.dot_general(d_op, h_op, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    else:      # dh = d @ w.T, dw = h.T @ d
        dh = jax.lax.dot_general(d_op, w_op, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        dw = jax.lax.dot_general(h_op, d_op, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return dh.astype(h_TD.dtype), dw.astype(w.dtype), None


_head_nll.defvjp(_head_nll_fwd, _head_nll_bwd)


def chunked_head_token_nll(h_BLD, w, targets_BL, *, chunks: int, scale: float = 1.0, tied: bool = False,
                           kernels=None, unroll: bool = False):
    """(nll_BL, lse_BL) as head_token_nll over B*L tokens, computed over the sequence in `chunks`
    pieces one after another, each rematerialized in the backward pass, so only one chunk's
    [B, L / chunks, V] float32 logits (and their gradient) are live at a time.

    Chunk c holds positions c, c + chunks, c + 2 * chunks, ... (a strided split keeps the length
    axis's sharding on the within-chunk axis, so the scan slices an unsharded one). chunks <= 1
    or a length it does not divide: one pass. The backward recomputes each chunk's logits (one
    more head matmul). unroll: straight-line chunks (for cost analysis; more memory)."""
    B, L, D = h_BLD.shape
    if chunks <= 1 or L % chunks:
        nll_T, lse_T = head_token_nll(h_BLD.reshape(B * L, D), w, targets_BL.reshape(B * L), scale=scale,
                                      tied=tied, kernels=kernels)
        return nll_T.reshape(B, L), lse_T.reshape(B, L)
    Lc = L // chunks
    h_CBlD = jnp.moveaxis(h_BLD.reshape(B, Lc, chunks, D), 2, 0)
    t_CBl = jnp.moveaxis(targets_BL.reshape(B, Lc, chunks), 2, 0)

    @jax.checkpoint
    def one_chunk(h_BlD, t_Bl):
        nll_T, lse_T = head_token_nll(h_BlD.reshape(B * Lc, D), w, t_Bl.reshape(B * Lc), scale=scale,
                                      tied=tied, kernels=kernels)
        return nll_T.reshape(B, Lc), lse_T.reshape(B, Lc)

    # A scan keeps one chunk's logits live (straight-line chunks let the scheduler overlap them);
    # unroll=True is for cost analysis, which counts a scan's body once.
    _, (nll_CBl, lse_CBl) = jax.lax.scan(lambda c, xs: (c, one_chunk(*xs)), None, (h_CBlD, t_CBl),
                                         unroll=bool(unroll))
    return (jnp.moveaxis(nll_CBl, 0, 2).reshape(B, L), jnp.moveaxis(lse_CBl, 0, 2).reshape(B, L))


def chunked_head_distill(h_BLD, mtp_h_PBLD, w, weights_PBL, *, chunks: int, tied: bool = False,
                         unroll: bool = False):
    """MTP self-distillation through the output head, one sequence chunk at a time: for each depth
    p, sum over tokens of weights * CE(softmax(stop_grad(h @ W)), log_softmax(mtp_h[p] @ W)).
    Returns (sum_P, weight_P) float32. The teacher (the main head's distribution) carries no
    gradient; the students' gradients reach mtp_h and W. Chunks as in chunked_head_token_nll
    (strided, rematerialized in the backward), so at most one chunk's [P, B, L / chunks, V]
    logits are live."""
    P, B, L, D = mtp_h_PBLD.shape
    c = chunks if chunks > 1 and L % chunks == 0 else 1
    Lc = L // c
    h_CBlD = jnp.moveaxis(h_BLD.reshape(B, Lc, c, D), 2, 0)
    m_CPBlD = jnp.moveaxis(mtp_h_PBLD.reshape(P, B, Lc, c, D), 3, 0)
    w_CPBl = jnp.moveaxis(weights_PBL.astype(jnp.float32).reshape(P, B, Lc, c), 3, 0)
    w_sg = jax.lax.stop_gradient(w)

    @jax.checkpoint
    def one_chunk(h_BlD, m_PBlD, w_PBl):
        teacher_TV = jax.nn.softmax(_logits(jax.lax.stop_gradient(h_BlD).reshape(B * Lc, D),
                                            w_sg.astype(h_BlD.dtype), 1.0, tied), axis=-1)
        wc = w.astype(m_PBlD.dtype)
        student_PTV = jax.vmap(lambda x: jax.nn.log_softmax(_logits(x.reshape(B * Lc, D), wc, 1.0, tied), -1))(m_PBlD)
        ce_PT = -jnp.sum(teacher_TV[None] * student_PTV, axis=-1)
        wt_PT = w_PBl.reshape(P, B * Lc)
        return jnp.sum(ce_PT * wt_PT, axis=1), jnp.sum(wt_PT, axis=1)

    if c == 1:
        return one_chunk(h_CBlD[0], m_CPBlD[0], w_CPBl[0])
    _, (s_CP, wt_CP) = jax.lax.scan(lambda carry, xs: (carry, one_chunk(*xs)), None, (h_CBlD, m_CPBlD, w_CPBl),
                                    unroll=bool(unroll))
    return jnp.sum(s_CP, axis=0), jnp.sum(wt_CP, axis=0)
