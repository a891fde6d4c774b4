"""Expert parallelism (EP): experts sharded over an EP group of mesh axes, tokens dispatched to
the experts' devices and combined back with all-to-all inside `jax.shard_map`.

The EP group is whatever the logical axis `experts` maps to under `config.mesh.rules`, e.g.
`("experts", ("data", "context"))` builds EP from data x context devices (the report's layout:
EP 8 = data 4 x CP 2 in CPT, EP 8 = CP 8 in RL), while dense weights are sharded by the
`embed -> (fsdp, context)` rule: two shardings (meshes) over the same devices.

Per MoE layer, on every device (T local tokens, K experts each, A = T*K assignments):
 1. sort assignments by destination EP rank, keep at most `cap` per destination
    (cap = T * min(K, E / EP), dropless, when mesh.ep_capacity_factor == 0: a token's K experts
    are distinct, so no more of its rows go to one peer), build a [EP, cap, D] send buffer;
 2. cast the rows to the expert dtype (MXFP8 values + E8M0 scales when model.quant is
    mxfp8/nvfp4) and all-to-all them (plus local expert ids) over the EP axes;
 3. run the local experts (sorted grouped matmul, the same gmm as the single-device path);
 4. all-to-all the outputs back in the model dtype (bf16 in production), weight and sum the k
    results in float32 and cast back.
With mesh.ep_exchange = "ragged", steps 1-4 send only the routed rows instead (c2jax.ops.ragged:
a ragged all-to-all into receive buffers of ep_capacity_factor x A rows, W x T x min(K, E / W)
when 0, dropless;
an assignment is dropped only when its receiver's buffer is full), and rows travel unquantized.
With mesh.ep_token_chunks = n > 1 the local tokens go through 1-4 in n chunks one after another
(capacity per chunk), each rematerialized in the backward pass, so the [W * cap, D] buffers
shrink n-fold. Expert weights FSDP-sharded over other axes (the `expert_fsdp`, `expert_embed` rules) are
all-gathered inside the shard_map, so their gradients leave it reduce-scattered.

Letters: B batch, L length, D model width, K experts per token, F expert width, E experts,
T local tokens, A local assignments, R received rows, W EP group size.
"""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from c2jax.config import ConfigError
from c2jax.parallel.mesh import (
    active_logical_axes,
    axes_size,
    divisible_axes,
    parallel_setting,
    row_axes,
    spec_entry,
)
from c2jax.ops.experts_xla import combine_rows, expert_ffn, inverse_permutation, join_gate_up, rows_of_tokens
from c2jax.ops.ragged import exchange, ragged_plan


def ep_axes() -> tuple:
    """Mesh axes of the active EP group (those the `experts` logical axis maps to, size > 1)."""
    return active_logical_axes("experts")


def ep_active() -> bool:
    return axes_size(ep_axes()) > 1


def exchange_name() -> str:
    """The EP path the mesh settings choose: "ep_ragged_all_to_all" (mesh.ep_exchange="ragged") or
    "ep_all_to_all"."""
    return "ep_ragged_all_to_all" if parallel_setting("ep_exchange", "capacity") == "ragged" else "ep_all_to_all"


def _quantized_all_to_all(x_RD, axes, quant: str, out_dtype):
    """all-to-all of token rows in the expert dtype: MXFP8 (E4M3 values + one E8M0 scale per 32)
    when quantized and D % 32 == 0, else out_dtype. The backward sends cotangents in out_dtype."""
    def a2a(t):
        return jax.lax.all_to_all(t, axes, 0, 0, tiled=True)

    if quant == "none" or x_RD.shape[-1] % 32:
        return a2a(x_RD.astype(out_dtype))

    from pallas_kernels.quant import dequantize_mxfp8, quantize_mxfp8

    @jax.custom_vjp
    def send(x):
        values, scales = quantize_mxfp8(x, axis=-1)
        return dequantize_mxfp8(a2a(values), a2a(scales), axis=-1, dtype=out_dtype)

    def fwd(x):
        return send(x), None

    def bwd(_, g):
        return (a2a(g.astype(out_dtype)).astype(x_RD.dtype),)

    send.defvjp(fwd, bwd)
    return send(x_RD)


def _local_experts(x_RD, eid_R, w_gate, w_up, w_down, gmm):
    """Rows with local expert id eid (== E_local for padding) through their expert, sorted by expert
    for the grouped matmuls `gmm`. Padding rows come out unspecified (no masking pass over the
    rows): both exchanges leave them unread, the ragged one by not sending them, the capacity one
    because the combine reads kept slots only, and their cotangents are zero."""
    e_local = weight_shape(w_gate)[0]
    order = jnp.argsort(eid_R, stable=True)
    inv = inverse_permutation(order)
    sizes = jnp.bincount(eid_R, length=e_local + 1)[:e_local].astype(jnp.int32)
    # sort and unsort as gathers both ways (permutations: K = 1 rows per "token")
    y_sorted = expert_ffn(rows_of_tokens(x_RD, order, inv[:, None], True), w_gate, w_up, w_down, sizes, gmm)
    return rows_of_tokens(y_sorted, inv, order[:, None], True)


def ep_plan(batch: int, length: int, num_experts: int):
    """(EP axes, token batch axes, token length axes) for a [batch, length] token block, or None
    when EP is off, or when the tokens cannot be split over every EP axis (e.g. the dummy batch of
    a shape-only init): then the caller uses the single-device dispatch and GSPMD (correct, but
    it gathers the expert weights), and a warning is logged."""
    axes = ep_axes()
    W = axes_size(axes)
    if W <= 1:
        return None
    if num_experts % W:
        raise ConfigError(f"model.num_experts={num_experts} is not divisible by the expert-parallel group "
                          f"{axes} of size {W}; change mesh.shape or the 'experts' rule in mesh.rules")
    b_axes = row_axes(batch)
    l_axes = divisible_axes(length, active_logical_axes("length"))
    missing = [a for a in axes if a not in b_axes + l_axes]
    if missing:
        key = (batch, length, axes)
        if key not in _WARNED and batch > 1:  # batch 1 = shape-only init or single-row decode
            _WARNED.add(key)
            _log.warning("expert parallelism over %s skipped for a [%d, %d] token block: %s shard neither "
                            "batch nor length (make them divisible by the mesh axes)", axes, batch, length, missing)
        return None
    return axes, b_axes, l_axes


_WARNED: set = set()
_log = logging.getLogger(__name__)


def expert_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, w_gate, w_up, w_down, quant, plan, gmm):
    """EP MoE dispatch + expert compute + combine. Returns (y_BLD in x's dtype, dropped fraction).
    `plan` from ep_plan; gmm(lhs, rhs, group_sizes): the grouped matmul each device runs its
    experts with (the kernel c2jax.ops.experts chose)."""
    B, L, D = x_BLD.shape
    E, K = weight_shape(w_gate)[0], ids_BLK.shape[-1]
    if plan is None:
        raise ConfigError("expert_parallel_dispatch called without an active expert-parallel mesh")
    axes, b_axes, l_axes = plan
    W = axes_size(axes)
    factor = float(parallel_setting("ep_capacity_factor", 0.0))
    chunks = int(parallel_setting("ep_token_chunks", 1))
    ragged = parallel_setting("ep_exchange", "capacity") == "ragged"
    e_local = E // W
    dt = x_BLD.dtype

    def per_peer_most(T):
        # a token's K experts are distinct, so at most min(K, E / W) of its rows go to one peer
        return T * min(K, e_local)

    def one_ragged(x_TD, ids_TK, wts_TK, wg, wu, wd):
        T = x_TD.shape[0]
        A = T * K
        most = W * per_peer_most(T)                   # dropless: the most rows any receiver can get
        R = most if factor <= 0 else min(most, max(1, math.ceil(factor * A)))   # receive rows
        flat = ids_TK.reshape(A).astype(jnp.int32)
        dest = flat // e_local
        order = jnp.argsort(dest, stable=True)        # send rows in peer order
        inv = inverse_permutation(order)
        dest_sorted = dest[order]
        plan = ragged_plan(jnp.bincount(dest, length=W), R, axes)
        rank_sorted = jnp.arange(A, dtype=jnp.int32) - plan.in_off[dest_sorted]
        kept_sorted = rank_sorted < plan.send[dest_sorted]    # rows past a receiver's R are dropped
        send_x = rows_of_tokens(x_TD, order // K, inv.reshape(T, K), True)
        # rows past the received ones stay unwritten: they sort last, outside every expert's group
        recv_x = exchange(send_x, jax.lax.empty((R, D), dt), plan, axes)
        recv_e = exchange((flat % e_local)[order], jnp.full((R,), e_local, jnp.int32), plan, axes)
        y_R = _local_experts(recv_x, recv_e, wg, wu, wd, gmm).astype(dt)
        back = exchange(y_R, jax.lax.empty((A, D), dt), plan, axes, back=True)   # dropped rows: unread
        row_TK = jnp.where(kept_sorted[inv], inv, A).reshape(T, K)      # A: dropped
        y = combine_rows(back, wts_TK, row_TK, jnp.where(kept_sorted, order, A), factor <= 0)  # dropless: all kept
        return y.astype(dt), jnp.mean((~kept_sorted).astype(jnp.float32))

    def one(x_TD, ids_TK, wts_TK, wg, wu, wd):
        if ragged:
            return one_ragged(x_TD, ids_TK, wts_TK, wg, wu, wd)
        T = x_TD.shape[0]
        A = T * K
        most = per_peer_most(T)
        cap = most if factor <= 0 else min(most, max(1, math.ceil(factor * A / W)))
        flat = ids_TK.reshape(A).astype(jnp.int32)
        dest = flat // e_local
        order = jnp.argsort(dest, stable=True)
        sizes = jnp.bincount(dest, length=W)
        starts = jnp.cumsum(sizes) - sizes
        rank_sorted = jnp.arange(A, dtype=jnp.int32) - starts[dest[order]]
        rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
        keep = rank < cap
        slot = jnp.where(keep, dest * cap + rank, W * cap)       # W*cap = drop sink
        # assignment of each send row (A: an empty row); rows <-> assignments are gathers both ways
        asg = jnp.full((W * cap + 1,), A, jnp.int32).at[slot].set(jnp.arange(A, dtype=jnp.int32))[: W * cap]
        row_TK = slot.reshape(T, K)
        send_x = rows_of_tokens(x_TD, asg // K, row_TK)
        send_e = jnp.take(flat % e_local, asg, mode="fill", fill_value=e_local)   # e_local: an empty row
        recv_x = _quantized_all_to_all(send_x, axes, quant, dt)
        recv_e = jax.lax.all_to_all(send_e, axes, 0, 0, tiled=True)
        y_R = _local_experts(recv_x, recv_e, wg, wu, wd, gmm).astype(dt)   # combine dtype
        back = jax.lax.all_to_all(y_R, axes, 0, 0, tiled=True)
        y = combine_rows(back, wts_TK, row_TK, asg)   # f32 sum over k; dropped rows add nothing
        return y.astype(dt), jnp.mean((~keep).astype(jnp.float32))  # exactly 0 when dropless

    def body(x, ids, wts, wg, wu, wd):
        b, l, _ = x.shape
        T = b * l
        n = chunks if chunks > 1 and T % chunks == 0 else 1
        flat = (x.reshape(n, T // n, D), ids.reshape(n, T // n, K), wts.reshape(n, T // n, K))
        if n == 1:
            y, dropped = one(*(a[0] for a in flat), wg, wu, wd)
        else:
            # token chunks one after another, each rematerialized in the backward pass: the
            # dispatch buffers ([W * cap, D] send/receive rows, expert activations) shrink n-fold
            y, dropped = jax.lax.map(jax.checkpoint(lambda a: one(*a, wg, wu, wd)), flat)
            dropped = jnp.mean(dropped)
        varying = tuple(dict.fromkeys(b_axes + l_axes + axes))  # dropped varies over the token axes
        return y.reshape(b, l, D), jax.lax.pmean(dropped, varying)

    return _over_token_shards(body, x_BLD, ids_BLK, weights_BLK, w_gate, w_up, w_down, axes, b_axes, l_axes)


def token_parallel_dispatch(x_BLD, ids_BLK, weights_BLK, w_gate, w_up, w_down, local_fn):
    """Experts computed where the tokens are, without expert parallelism: each device runs
    local_fn(x_TD, ids_TK, weights_TK, wg, wu, wd) -> (y_TD, dropped) on its tokens with every
    expert's weights (a Mosaic kernel cannot be partitioned by GSPMD)."""
    B, L, D = x_BLD.shape
    K = ids_BLK.shape[-1]
    b_axes, l_axes = row_axes(B), divisible_axes(L, active_logical_axes("length"))
    token_axes = tuple(dict.fromkeys(b_axes + l_axes))

    def body(x, ids, wts, wg, wu, wd):
        b, l, _ = x.shape
        y, dropped = local_fn(x.reshape(b * l, D), ids.reshape(b * l, K), wts.reshape(b * l, K), wg, wu, wd)
        dropped = jax.lax.pmean(dropped, token_axes) if token_axes else dropped
        return y.reshape(b, l, D).astype(x.dtype), dropped

    return _over_token_shards(body, x_BLD, ids_BLK, weights_BLK, w_gate, w_up, w_down, (), b_axes, l_axes)


def _over_token_shards(body, x_BLD, ids_BLK, weights_BLK, w_gate, w_up, w_down, expert_axes, b_axes, l_axes):
    """shard_map of body(x, ids, wts, wg, wu, wd) -> (y, dropped) over the token axes, the expert
    weights split over `expert_axes` and their FSDP shards (E over `expert_fsdp`, D and F over
    `expert_embed` / `expert_mlp`) all-gathered inside: the backward then reduce-scatters their
    gradients (f32 [E/W, D, F] per chip, not replicated over fsdp). Under EP, gate and up reach
    body joined (join_gate_up; None in up's place, as expert_ffn takes them): the local experts'
    weights are W-fold smaller than the rows they meet, and one [D, 2F] product reads the rows
    once. Without EP every chip gathers all E experts, and a joined [E, D, 2F] gather and its
    gradient are buffers twice as large (Qwen3 FSDP 64: peak HBM 11.76 -> 12.48 GiB), so they
    stay apart."""
    join = bool(expert_axes)
    tok = P(spec_entry(b_axes), spec_entry(l_axes), None)
    fe, fd, ff = _weight_fsdp_axes(expert_axes, weight_shape(w_gate))   # FSDP axes of E, D, F
    stored = expert_axes + fe
    in_spec = _weight_specs(w_gate, stored, fd, ff)
    out_spec = _weight_specs(w_down, stored, ff, fd)

    def fsdp_body(x, ids, wts, wg, wu, wd):
        # joined gate and up ([E, D, 2F], expert_ffn's w_up=None form): joining the local shards
        # before the gather makes one all-gather and no joined copy of the gathered weights;
        # when F itself is split, the gathered halves are joined instead
        if join and not ff:
            wg, wu = join_gate_up(wg, wu), None
        wg, wu = (_gather_dims(w, fe, fd, ff) for w in (wg, wu))     # None stays None
        if join and wu is not None:
            wg, wu = join_gate_up(wg, wu), None
        return body(x, ids, wts, wg, wu, _gather_dims(wd, fe, ff, fd))

    fn = jax.shard_map(fsdp_body, in_specs=(tok, tok, tok, in_spec, in_spec, out_spec), out_specs=(tok, P()))
    return fn(x_BLD, ids_BLK, weights_BLK, w_gate, w_up, w_down)


def _weight_fsdp_axes(ep, shape) -> tuple:
    """Mesh axes (not in the EP group, dividing the dim) that an [E, D, F] expert weight's dims
    are sharded over beyond EP, from the rules its params are sharded by (`expert_weights`,
    `expert_embed`, `expert_mlp`), claimed in that order as the param shardings claim them: the
    FSDP part of its sharding."""
    E, D, F = shape
    out, used = [], set(ep)
    for name, dim in (("expert_weights", E // axes_size(ep)), ("expert_embed", D), ("expert_mlp", F)):
        cand = tuple(a for a in active_logical_axes(name) if a not in used)
        keep = divisible_axes(dim, cand)
        used.update(keep)
        out.append(keep)
    return tuple(out)


def weight_shape(w) -> tuple:
    """[E, X, Y] of an expert weight: a float array, or pre-quantized (pallas_kernels.QuantizedExperts)."""
    return tuple(getattr(w, "values_GKN", w).shape)


def _weight_specs(w, expert_axes, axes1, axes2):
    """shard_map spec(s) of an [E, X, Y] expert weight split over expert_axes (dim 0), axes1 (dim 1)
    and axes2 (dim 2); for a QuantizedExperts one per leaf (block scales [E, X/block, Y] like the
    values, a channel scale [E, Y] without dim 1)."""
    def spec(leaf):
        if leaf.ndim == 2:
            return P(spec_entry(expert_axes), spec_entry(axes2))
        if axes1 and leaf.shape[1] % axes_size(axes1):
            raise ConfigError(f"quantized expert scales of shape {leaf.shape} cannot be split over {axes1} "
                              f"(expert_embed / expert_mlp FSDP in mesh.rules); map them to fewer axes")
        return P(spec_entry(expert_axes), spec_entry(axes1), spec_entry(axes2))
    return spec(w) if hasattr(w, "ndim") else jax.tree.map(spec, w)


def _gather_dims(w, axes0, axes1, axes2):
    """All-gather a local [E, X, Y] weight block over axes0 (dim 0), axes1 (dim 1) and axes2
    (dim 2) (each leaf of a QuantizedExperts: a channel scale [E, Y] over axes0 and axes2)."""
    def gather(leaf):
        if axes0:
            leaf = jax.lax.all_gather(leaf, axes0, axis=0, tiled=True)
        if axes1 and leaf.ndim == 3:
            leaf = jax.lax.all_gather(leaf, axes1, axis=1, tiled=True)
        if axes2:
            leaf = jax.lax.all_gather(leaf, axes2, axis=leaf.ndim - 1, tiled=True)
        return leaf
    return gather(w) if hasattr(w, "ndim") else jax.tree.map(gather, w)
