"""Ragged all-to-all for the EP exchange: each device sends only the rows routed to each peer
(no fixed-capacity padding) into a receive buffer of R rows, and gets the results back.

`ragged_plan` turns every device's per-peer row counts into offsets: the counts are all-gathered
(S[p, q] = rows device p sends to device q); a receiver stores its senders' rows in rank order,
and rows that would land past its R rows are dropped, which each sender computes for its own
rows (so it knows which of its assignments were dropped). `exchange` moves rows along a plan:
forward (send buffer -> receive buffer) or back (receive buffer -> where the rows came from).

On TPU and GPU the collective is jax.lax.ragged_all_to_all. XLA:CPU has no such op, so on CPU
(the tests' 8 host devices) the same exchange runs as an all_to_all of [W, M, ...] blocks of
worst-case size M and gathers / scatters around it: the same plan, the same result.

Letters: W devices in the exchange, M rows of the operand, N rows of the output.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from c2jax.ops.target import current_target
from pallas_kernels._common import match_vma


class RaggedPlan(NamedTuple):
    """Per device, int32 [W] each (q: a receiver of my rows, p: a sender of rows to me)."""
    in_off: jax.Array     # where my rows for q start in my send buffer
    send: jax.Array       # how many of them reach q (the rest overflowed q's buffer)
    out_off: jax.Array    # where they land in q's receive buffer
    recv_off: jax.Array   # where p's rows sit in my receive buffer
    recv: jax.Array       # how many rows I receive from p


def ragged_plan(sizes_W, recv_rows: int, axes) -> RaggedPlan:
    """Offsets for sending sizes_W[q] rows (contiguous, in peer order) to each peer q of the
    `axes` group, into receive buffers of recv_rows rows each."""
    sizes_W = sizes_W.astype(jnp.int32)
    W = sizes_W.shape[0]
    S_WW = jax.lax.all_gather(sizes_W, axes, tiled=False).reshape(W, W)   # [sender, receiver]
    me = jax.lax.axis_index(axes)
    in_off = jnp.cumsum(sizes_W) - sizes_W
    lower_W1 = (jnp.arange(W) < me)[:, None]
    out_off = jnp.sum(jnp.where(lower_W1, S_WW, 0), axis=0).astype(jnp.int32)
    send = jnp.clip(recv_rows - out_off, 0, sizes_W).astype(jnp.int32)
    col_W = S_WW[:, me]
    recv_off = (jnp.cumsum(col_W) - col_W).astype(jnp.int32)
    recv = jnp.clip(recv_rows - recv_off, 0, col_W).astype(jnp.int32)
    return RaggedPlan(in_off.astype(jnp.int32), send, out_off, recv_off, recv)


def exchange(x, out, plan: RaggedPlan, axes, *, back: bool = False):
    """Rows of x sent along `plan` into `out` (rows not written keep out's values). Forward: x
    is the send buffer, out the receive buffer; back=True: x is the receive buffer and each
    sender's rows return to where they started in its send buffer (out). On a CPU target the
    dense form (XLA:CPU has no ragged all-to-all)."""
    dense = current_target().platform == "cpu"
    if back:
        in_off, send, recv = plan.recv_off, plan.recv, plan.send
        out_off = jax.lax.all_to_all(plan.in_off, axes, 0, 0, tiled=True)   # senders' in_off[me]
    else:
        in_off, send, out_off, recv = plan.in_off, plan.send, plan.out_off, plan.recv
    out = match_vma(out, x, *plan)    # inside shard_map the result varies like what it is sent from
    if not dense:
        return jax.lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=axes)
    return _dense_ragged_all_to_all(x, out, in_off, send, out_off, recv, axes)


def _dense_ragged_all_to_all(x, out, in_off, send, out_off, recv, axes):
    """jax.lax.ragged_all_to_all's semantics with a dense all_to_all (CPU)."""
    M, N = x.shape[0], out.shape[0]
    j_M = jnp.arange(M, dtype=jnp.int32)
    src_WM = in_off[:, None] + j_M[None]
    blocks = jnp.take(x, jnp.where(j_M[None] < send[:, None], src_WM, M), axis=0, mode="fill", fill_value=0)
    got = jax.lax.all_to_all(blocks, axes, 0, 0, tiled=True)           # [W senders, M, ...]
    at_W = jax.lax.all_to_all(out_off, axes, 0, 0, tiled=True)          # my offset for each sender
    dst_WM = jnp.where(j_M[None] < recv[:, None], at_W[:, None] + j_M[None], N)
    return out.at[dst_WM.reshape(-1)].set(got.reshape((-1,) + x.shape[1:]), mode="drop")
