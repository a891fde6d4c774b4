"""XLA implementations of the routed-expert FFN (registered in c2jax.ops.experts): sorted grouped
matmuls (pallas_kernels' gmm), per-token gathers, capacity einsum, CPU expert-aligned blocks, and
the decode layouts over per-expert buffers (split / sharded).

Letters: T tokens (B*L), D model width, E experts, K experts per token, F expert MLP width,
C capacity per expert, A assignments (T*K), R rows, W window.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2jax.backends.cpu.kernels import ffn_column_split  # the CPU decode layouts' column split
from c2jax.ops import remat

# ----------------------------------------------------------------------------- dispatch


def join_gate_up(w_gate_EDF, w_up_EDF):
    """Gate and up weights joined along their last dim, [E, D, 2F] (float, or QuantizedExperts:
    every leaf ends in F)."""
    return jax.tree.map(lambda g, u: jnp.concatenate([g, u], axis=-1), w_gate_EDF, w_up_EDF)


def expert_ffn(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E, gmm):
    """SwiGLU of rows sorted by expert (group_sizes_E rows each) as grouped matmuls gmm(lhs, rhs, sizes).
    w_up_EDF None: w_gate_EDF holds gate and up joined (join_gate_up), run as one [D, 2F] product,
    which reads the rows once and makes the backward's dX one product instead of two and a sum."""
    if w_up_EDF is not None:
        gate = remat.tag(gmm(x_MD, w_gate_EDF, group_sizes_E), remat.MLP_IN)
        up = remat.tag(gmm(x_MD, w_up_EDF, group_sizes_E), remat.MLP_IN)
        return remat.tag(gmm(nn.silu(gate) * up, w_down_EFD, group_sizes_E), remat.MLP_OUT)
    F = getattr(w_gate_EDF, "values_GKN", w_gate_EDF).shape[-1] // 2
    h_M2F = remat.tag(gmm(x_MD, w_gate_EDF, group_sizes_E), remat.MLP_IN)
    return remat.tag(gmm(nn.silu(h_M2F[:, :F]) * h_M2F[:, F:], w_down_EFD, group_sizes_E), remat.MLP_OUT)


def grouped_matmul(quant: str, impl: str, tiling=None):
    """gmm(lhs, rhs, group_sizes) through pallas_kernels with a concrete impl ("pallas": Mosaic,
    "interpret": the same kernel interpreted, "xla": the row-tiled fallback, "ragged": ragged_dot);
    tiling: the Mosaic kernels' (tm, tk, tn), None = chosen per call shape."""
    import pallas_kernels

    def gmm(lhs, rhs, gs):
        return pallas_kernels.gmm(lhs, rhs, gs.astype(jnp.int32), quant=quant, impl=impl,
                                  preferred_element_type=lhs.dtype, tiling=tiling)
    return gmm


def sort_assignments(ids_TK, num_experts):
    """Order of the T*K assignments sorted by expert, inverse order, and group sizes."""
    flat_A = ids_TK.reshape(-1)
    order_A = jnp.argsort(flat_A, stable=True)
    group_sizes_E = jnp.bincount(flat_A, length=num_experts).astype(jnp.int32)
    return order_A, group_sizes_E


def inverse_permutation(order_A):
    """inv with inv[order[a]] = a (one int32 scatter of [A], not a sort)."""
    A = order_A.shape[0]
    return jnp.zeros((A,), jnp.int32).at[order_A].set(jnp.arange(A, dtype=jnp.int32))


def grouped_dispatch(x_TD, ids_TK, weights_TK, w_gate, w_up, w_down, quant="none", gmm=None):
    """Dropless: sort assignments by expert, grouped matmuls, unsort, weighted sum over k. The
    sort and unsort are gathers in both directions (rows_of_tokens, combine_rows): no scatter
    and no f32 [T*K, D] buffer in the forward or backward pass."""
    T, K = ids_TK.shape
    E = getattr(w_gate, "values_GKN", w_gate).shape[0]  # float or pre-quantized QuantizedExperts
    order_A, group_sizes_E = sort_assignments(ids_TK, E)
    row_TK = inverse_permutation(order_A).reshape(T, K)   # sorted row of assignment (t, k)
    x_AD = rows_of_tokens(x_TD, order_A // K, row_TK, True)      # permutations: every index in range
    y_AD = expert_ffn(x_AD, w_gate, w_up, w_down, group_sizes_E, gmm or grouped_matmul(quant, "xla"))
    out = combine_rows(y_AD, weights_TK, row_TK, order_A, True)
    return out.astype(x_TD.dtype), jnp.zeros((), jnp.float32)


def gather_dispatch(x_TD, ids_TK, weights_TK, w_gate, w_up, w_down):
    """Dropless, reading only the chosen experts' weights per token ([T, K, D, F] gathers). The
    cheapest path when few tokens touch fewer than all experts (T * K < E: decode steps)."""
    f32, dt = jnp.float32, x_TD.dtype
    gate = jnp.einsum("td,tkdf->tkf", x_TD, w_gate[ids_TK], preferred_element_type=f32).astype(dt)
    up = jnp.einsum("td,tkdf->tkf", x_TD, w_up[ids_TK], preferred_element_type=f32).astype(dt)
    y_TKD = jnp.einsum("tkf,tkfd->tkd", nn.silu(gate) * up, w_down[ids_TK], preferred_element_type=f32)
    out = jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(f32))
    return out.astype(dt), jnp.zeros((), f32)


def window_widths(n_assignments: int) -> list[int]:
    """Row windows of split_dispatch: 1, 2, 4, ... up to the first power of two >= A."""
    return [1 << i for i in range(max(n_assignments - 1, 0).bit_length() + 1)]


ROW_WISE_MAX_ROWS = 4  # split_dispatch windows up to this many rows run as one-row matmuls


def split_experts(w_gate_EDF, w_up_EDF, w_down_EFD):
    """Per-expert buffers for split_dispatch: ((w_gate_up_D2F, w_down_FD), ...), gate and up
    concatenated (one matmul reads both; larger matmuls run faster on CPU)."""
    return tuple((jnp.concatenate([w_gate_EDF[e], w_up_EDF[e]], axis=1), w_down_EFD[e])
                 for e in range(w_gate_EDF.shape[0]))


@jax.tree_util.register_pytree_node_class
class ShardedExperts:
    """Expert weights spread over a 1-D mesh of n host devices for decode on CPU, where XLA
    runs one device's matmuls one after another, so n devices stream weights from n cores at
    once; built by shard_experts. Two layouts (`split`), each slot's arrays sharded on axis 0
    (row d on device d):
      "ffn":    slots[e] = (w_gate_up [n, D, 2f], w_down [n, f, D]), f = F / n: device d holds
                hidden columns [d f, (d + 1) f) of every expert (gate and up slices side by
                side), so each device reads 1/n of every chosen expert: the same bytes on
                every device whichever experts the batch picks;
      "expert": slots[j] = (w_gate_up [n, D, 2F], w_down [n, F, D]): row d is expert
                d * len(slots) + j, so a device reads only its own experts, however many of
                them were picked."""

    def __init__(self, slots, mesh, split: str):
        self.slots, self.mesh, self.split = tuple(slots), mesh, split

    def tree_flatten(self):
        return (self.slots,), (self.mesh, self.split)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def shard_experts(w_gate_EDF, w_up_EDF, w_down_EFD, mesh, split: str | None = None) -> ShardedExperts:
    """Stacked expert weights -> ShardedExperts for a 1-D mesh of n devices. split: "ffn"
    (needs n | F), "expert" (needs n | E) or None: "ffn" when n divides F, else "expert".
    "ffn" is the default because it balances the devices: at batch 8 with 16 experts top-2,
    "expert" left one device with more of the picked experts than the other in most steps
    (isolated MoE layer, 2 devices: 1.71 ms a step against 1.87). Jit-friendly: the arrays
    are not placed; put them on the mesh with P(axis) on their leading dim."""
    n, (E, D, F) = mesh.size, w_gate_EDF.shape
    if split is None:
        split = "ffn" if F % n == 0 else "expert"
    if split == "ffn" and F % n == 0:
        wgu_nED2f, wd_nEfD = ffn_column_split(w_gate_EDF, w_up_EDF, w_down_EFD, n)
        return ShardedExperts([(wgu_nED2f[:, e], wd_nEfD[:, e]) for e in range(E)], mesh, "ffn")
    if split == "expert" and E % n == 0:
        wgu_nPD2F = jnp.concatenate([w_gate_EDF, w_up_EDF], axis=2).reshape(n, E // n, D, 2 * F)
        wd_nPFD = w_down_EFD.reshape(n, E // n, F, D)
        return ShardedExperts([(wgu_nPD2F[:, j], wd_nPFD[:, j]) for j in range(E // n)], mesh, "expert")
    raise ValueError(f"cannot split {E} experts of hidden size {F} over {n} devices by {split!r}: "
                     f"'ffn' needs {n} to divide {F}, 'expert' needs {n} to divide {E}")


def split_dispatch(x_TD, ids_TK, weights_TK, experts, packed_ffn=None):
    """Dropless over per-expert weight buffers: experts[e] = (w_gate_up_D2F, w_down_FD), each its
    own array (split_experts), or a ShardedExperts (each device runs its slice of the experts;
    the partial outputs are summed), or a cpu_kernels.PackedExperts (one FFI call a device that
    reads each chosen expert once; the CPU decode path's default where it builds). Assignments are sorted by expert; each expert that some token chose runs one
    SwiGLU on a window of the sorted rows starting at its first row, the window being the
    smallest power of two >= its count (lax.switch; padded to the widest window W); unchosen
    experts are skipped. So a step reads only the chosen experts' weights, once each, where
    they lie: on CPU XLA copies any slice of a stacked [E, D, F] array before a matmul reads
    it (the decode path, c2jax.sampling.unrolled, keeps experts split for this). Their rows
    are written back in place, each expert's own rows only. Windows of <= ROW_WISE_MAX_ROWS
    rows run as one-row matmuls (XLA CPU's few-row matmuls stream weights slower than one-row ones)."""
    dt = x_TD.dtype
    if packed_ffn is not None:
        out_TD = packed_ffn(x_TD, ids_TK, weights_TK, experts)
    elif isinstance(experts, ShardedExperts):
        out_TD = _sharded_split(x_TD, ids_TK, weights_TK, experts)
    else:
        out_TD = _split_local(x_TD, ids_TK, weights_TK, experts)
    return out_TD.astype(dt), jnp.zeros((), jnp.float32)


def _sharded_split(x_TD, ids_TK, weights_TK, ex: ShardedExperts):
    from jax.sharding import PartitionSpec as P
    axis, per = ex.mesh.axis_names[0], len(ex.slots)

    def local(x_TD, ids_TK, weights_TK, slots):
        experts = tuple((wgu[0], wd[0]) for wgu, wd in slots)
        if ex.split == "ffn":  # every expert, this device's hidden columns: partial sums over F
            return jax.lax.psum(_split_local(x_TD, ids_TK, weights_TK, experts), axis)
        local_TK = ids_TK - jax.lax.axis_index(axis) * per
        mine_TK = (local_TK >= 0) & (local_TK < per)
        out_TD = _split_local(x_TD, jnp.where(mine_TK, local_TK, per), jnp.where(mine_TK, weights_TK, 0),
                              experts)
        return jax.lax.psum(out_TD, axis)

    return jax.shard_map(local, mesh=ex.mesh, in_specs=(P(), P(), P(), P(axis)), out_specs=P(),
                         check_vma=False)(x_TD, ids_TK, weights_TK, ex.slots)


def _split_local(x_TD, ids_TK, weights_TK, experts):
    """split_dispatch over local buffers; ids == len(experts) marks an assignment no local expert
    serves (its output row stays 0). Returns the f32 weighted sum [T, D]."""
    T, K = ids_TK.shape
    E, A, D = len(experts), T * K, x_TD.shape[-1]
    f32, dt = jnp.float32, x_TD.dtype
    order_A, n_E = sort_assignments(ids_TK, E + 1)
    start_E = (jnp.cumsum(n_E) - n_E).astype(jnp.int32)
    widths = window_widths(A)
    W = widths[-1]
    branch_E = jnp.where(n_E > 0, 1 + jnp.sum(jnp.asarray(widths)[None] < n_E[:, None], axis=1), 0)
    x_RD = jnp.concatenate([x_TD[order_A // K], jnp.zeros((W, D), dt)])

    def ffn(x_mD, wgu, wd):
        h_m2F = jnp.dot(x_mD, wgu, preferred_element_type=f32).astype(dt)
        F = wd.shape[0]
        return jnp.dot(nn.silu(h_m2F[:, :F]) * h_m2F[:, F:], wd, preferred_element_type=f32).astype(dt)

    def window(w, wgu, wd, s):
        x_wD = jax.lax.dynamic_slice_in_dim(x_RD, s, w)
        if 1 < w <= ROW_WISE_MAX_ROWS:
            y_wD = jnp.concatenate([ffn(x_wD[i:i + 1], wgu, wd) for i in range(w)])
        else:
            y_wD = ffn(x_wD, wgu, wd)
        return jnp.pad(y_wD, ((0, W - w), (0, 0)))

    y_RD = jnp.zeros_like(x_RD)
    for e, (wgu, wd) in enumerate(experts):
        branches = [lambda: jnp.zeros((W, D), dt)]
        branches += [functools.partial(window, w, wgu, wd, start_E[e]) for w in widths]
        y_WD = jax.lax.switch(branch_E[e], branches)
        old_WD = jax.lax.dynamic_slice_in_dim(y_RD, start_E[e], W)
        mine_W1 = (jnp.arange(W) < n_E[e])[:, None]
        y_RD = jax.lax.dynamic_update_slice_in_dim(y_RD, jnp.where(mine_W1, y_WD, old_WD), start_E[e], 0)
    y_TKD = jnp.zeros((A, D), dt).at[order_A].set(y_RD[:A]).reshape(T, K, D)
    return jnp.einsum("tkd,tk->td", y_TKD.astype(f32), weights_TK.astype(f32))


MIN_DROPLESS_CAPACITY = 64


def capacity(T: int, K: int, E: int, capacity_factor: float | None) -> int:
    """Rows each expert takes: T (every assignment: dropless) when capacity_factor is None; else
    factor * T * K / E, at least MIN_DROPLESS_CAPACITY (small token counts stay dropless), at most T."""
    if capacity_factor is None:
        return T
    return min(T, max(int(math.ceil(capacity_factor * T * K / E)), MIN_DROPLESS_CAPACITY))


def dropped_fraction(ids_TK, E: int, cap: int):
    """Fraction of the assignments past their expert's first `cap` (0 when cap >= T)."""
    T, K = ids_TK.shape
    if cap >= T:
        return jnp.zeros((), jnp.float32)
    n_E = jnp.zeros((E,), jnp.int32).at[ids_TK.reshape(-1)].add(1, mode="drop")
    return (jnp.sum(jnp.maximum(n_E - cap, 0)) / (T * K)).astype(jnp.float32)


def capacity_dispatch(x_TD, ids_TK, weights_TK, w_gate, w_up, w_down, cap: int):
    """Each expert takes its first `cap` assignments (in token order), gathered into [E, cap, D]
    for one batched einsum; the rest are dropped (their fraction is returned)."""
    T, K = ids_TK.shape
    E = w_gate.shape[0]
    order_A, group_sizes_E = sort_assignments(ids_TK, E)
    flat_A = ids_TK.reshape(-1)
    starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    rank_sorted_A = jnp.arange(T * K, dtype=jnp.int32) - starts_E[flat_A[order_A]]
    rank_A = jnp.zeros_like(rank_sorted_A).at[order_A].set(rank_sorted_A)
    keep_A = rank_A < cap
    slot_A = jnp.where(keep_A, flat_A * cap + rank_A, E * cap)
    token_A = jnp.arange(T * K, dtype=jnp.int32) // K
    buf = jnp.zeros((E * cap + 1, x_TD.shape[-1]), x_TD.dtype).at[slot_A].set(x_TD[token_A])
    x_ECD = buf[: E * cap].reshape(E, cap, -1)
    gate = jnp.einsum("ecd,edf->ecf", x_ECD, w_gate)
    up = jnp.einsum("ecd,edf->ecf", x_ECD, w_up)
    y_ECD = jnp.einsum("ecf,efd->ecd", nn.silu(gate) * up, w_down)
    y_TKD = _take_rows(y_ECD.reshape(E * cap, -1), slot_A).reshape(T, K, -1)   # slot E*cap (dropped): 0
    out = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK.astype(jnp.float32))
    dropped = jnp.mean((~keep_A).astype(jnp.float32))  # exactly 0 when nothing is dropped
    return out.astype(x_TD.dtype), dropped


# Rows per block of the CPU capacity path: padding waste is ~E * b / 2 rows, per-block overhead is
# a loop step and three [b, D] x [D, F] products (128 was fastest on the 89M bench shape).
CPU_BLOCK_ROWS = 128


def block_dispatch(x_TD, ids_TK, weights_TK, w_gate, w_up, w_down, cap, block=None):
    """Capacity dispatch as expert-aligned blocks. Kept assignments (rank < cap within their expert,
    in token order) are gathered, sorted by expert, into R = NB * b rows where each expert's rows
    start on a block boundary (rows R' = occupied blocks * b; the rest stay zero and are skipped);
    `_block_ffn` loops over the occupied blocks only; results are gathered back per assignment."""
    T, K = ids_TK.shape
    E = w_gate.shape[0]
    A = T * K
    b = max(1, min(block or CPU_BLOCK_ROWS, cap))
    nb = min(E * -(-cap // b), A // b + E)            # static bound on occupied blocks
    R = nb * b
    order_A, n_E = sort_assignments(ids_TK, E)
    flat_A = ids_TK.reshape(-1)
    starts_E = jnp.cumsum(n_E) - n_E
    nblk_E = (jnp.minimum(n_E, cap) + b - 1) // b
    blk_hi_E = jnp.cumsum(nblk_E).astype(jnp.int32)
    blk_lo_E = blk_hi_E - nblk_E
    e_sorted_A = flat_A[order_A]
    rank_sorted_A = jnp.arange(A, dtype=jnp.int32) - starts_E[e_sorted_A]
    row_sorted_A = jnp.where(rank_sorted_A < cap, blk_lo_E[e_sorted_A] * b + rank_sorted_A, R)
    asg_R = jnp.full((R + 1,), A, jnp.int32).at[row_sorted_A].set(order_A)[:R]  # A: an empty row
    row_A = jnp.zeros((A,), jnp.int32).at[order_A].set(row_sorted_A)             # R: dropped
    x_RD = rows_of_tokens(x_TD, asg_R // K, row_A.reshape(T, K))
    y_RD = _block_ffn(x_RD, w_gate, w_up, w_down, blk_lo_E, blk_hi_E, b)
    out = combine_rows(y_RD, weights_TK.astype(y_RD.dtype), row_A.reshape(T, K), asg_R)
    dropped = jnp.mean((row_A >= R).astype(jnp.float32))  # exactly 0 when nothing is dropped
    return out.astype(x_TD.dtype), dropped


# Token rows <-> expert rows. Each kept assignment (t, k) is one row r: row_TK[t, k] = r and
# src_R[r] = t (src T and row R mean none). Both directions are gathers, so each backward is the
# other gather (autodiff would scatter-add into a zero-filled buffer instead). Out-of-range
# indices read zeros (fill mode): no padded copy of the operand. Callers whose maps are
# permutations (dropless sorts) pass in_bounds=True: then the gathers carry no fill select,
# which on TPU is a separate pass over the rows (the gather itself is offloaded and cannot fuse it).
def _take_rows(a_ND, idx, in_bounds=False):
    if in_bounds:
        return jnp.take(a_ND, idx, axis=0, mode="clip")    # clamps the indices, not the rows
    return jnp.take(a_ND, idx, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def rows_of_tokens(x_TD, src_R, row_TK, in_bounds=False):
    """x_RD[r] = x_TD[src_R[r]] (zero where src_R = T; in_bounds: every index of src_R and
    row_TK is in range)."""
    return _take_rows(x_TD, src_R, in_bounds)


def _rows_of_tokens_fwd(x_TD, src_R, row_TK, in_bounds):
    return rows_of_tokens(x_TD, src_R, row_TK, in_bounds), (src_R, row_TK)


def _rows_of_tokens_bwd(in_bounds, res, dx_RD):
    src_R, row_TK = res
    return jnp.sum(_take_rows(dx_RD, row_TK, in_bounds), axis=1), None, None


rows_of_tokens.defvjp(_rows_of_tokens_fwd, _rows_of_tokens_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def combine_rows(y_RD, weights_TK, row_TK, asg_R, in_bounds=False):
    """out_TD = sum_k weights_TK[t, k] * y_RD[row_TK[t, k]], accumulated in float32 (dropped rows
    add nothing). Written as multiply + reduce, which XLA fuses with the gather and the cast, so
    no f32 [T, K, D] copy of y is made (a dot would materialize its converted operand)."""
    y_TKD = _take_rows(y_RD, row_TK, in_bounds).astype(jnp.float32)
    return jnp.sum(y_TKD * weights_TK.astype(jnp.float32)[:, :, None], axis=1)


def _combine_rows_fwd(y_RD, weights_TK, row_TK, asg_R, in_bounds):
    return combine_rows(y_RD, weights_TK, row_TK, asg_R, in_bounds), (y_RD, weights_TK, row_TK, asg_R)


def _combine_rows_bwd(in_bounds, res, dout_TD):
    y_RD, weights_TK, row_TK, asg_R = res
    K = row_TK.shape[1]
    dout_TD = dout_TD.astype(jnp.float32)
    # row r of assignment a = t * K + k gets weights[t, k] * dout[t]; rows with no assignment get 0
    w_A = _take_rows(weights_TK.reshape(-1).astype(jnp.float32), asg_R, in_bounds)
    dy_RD = w_A[:, None] * _take_rows(dout_TD, asg_R // K, in_bounds)
    dw_TK = jnp.sum(_take_rows(y_RD, row_TK, in_bounds).astype(jnp.float32) * dout_TD[:, None, :], axis=2)
    return dy_RD.astype(y_RD.dtype), dw_TK.astype(weights_TK.dtype), None, None


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _block_ffn(x_RD, w_gate, w_up, w_down, blk_lo_E, blk_hi_E, b):
    """SwiGLU per block: rows of block i (in [blk_lo_E[e], blk_hi_E[e]) for expert e) use expert
    e's weights; blocks outside every range are left zero. Loops run only over occupied blocks."""
    return _block_ffn_fwd(x_RD, w_gate, w_up, w_down, blk_lo_E, blk_hi_E, b)[0]


# An expert's blocks run CPU_BLOCK_GROUP at a time while that many are left, then one by one:
# [4b, D] x [D, F] products run ~1.4x faster than [b, D] ones on XLA CPU, and the padding stays
# under b rows per expert.
CPU_BLOCK_GROUP = 4


def _over_expert_blocks(lo, hi, b, step, carry):
    """carry = step(first row, rows, carry) over blocks [lo, hi): groups of CPU_BLOCK_GROUP
    blocks, then single blocks (rows is static in each loop)."""
    g = CPU_BLOCK_GROUP
    n_groups = (hi - lo) // g
    carry = jax.lax.fori_loop(0, n_groups, lambda i, c: step((lo + i * g) * b, g * b, c), carry)
    return jax.lax.fori_loop(lo + n_groups * g, hi, lambda i, c: step(i * b, b, c), carry)


def _block_ffn_fwd(x_RD, w_gate, w_up, w_down, blk_lo_E, blk_hi_E, b):
    R, D = x_RD.shape
    E, _, F = w_gate.shape

    def expert(e, carry):
        wg, wu, wd = w_gate[e], w_up[e], w_down[e]

        def rows(r0, n, c):
            y, g, u = c
            x_nD = jax.lax.dynamic_slice_in_dim(x_RD, r0, n)
            g_nF, u_nF = x_nD @ wg, x_nD @ wu
            y_nD = (nn.silu(g_nF) * u_nF) @ wd
            return tuple(jax.lax.dynamic_update_slice_in_dim(a, v, r0, 0) for a, v in
                         ((y, y_nD), (g, g_nF), (u, u_nF)))
        return _over_expert_blocks(blk_lo_E[e], blk_hi_E[e], b, rows, carry)

    init = (jnp.zeros((R, D), x_RD.dtype), jnp.zeros((R, F), x_RD.dtype), jnp.zeros((R, F), x_RD.dtype))
    y, g, u = jax.lax.fori_loop(0, E, expert, init)
    return y, (x_RD, w_gate, w_up, w_down, blk_lo_E, blk_hi_E, g, u)


def _block_ffn_bwd(b, res, dy_RD):
    x_RD, w_gate, w_up, w_down, blk_lo_E, blk_hi_E, g_RF, u_RF = res
    E = w_gate.shape[0]

    def expert(e, carry):
        dx, dwg, dwu, dwd = carry
        wg, wu, wd = w_gate[e], w_up[e], w_down[e]

        def rows(r0, n, c):
            dx, dwg_e, dwu_e, dwd_e = c
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, r0, n)  # noqa: E731
            x_nD, g_nF, u_nF, dy_nD = sl(x_RD), sl(g_RF), sl(u_RF), sl(dy_RD)
            sig = jax.nn.sigmoid(g_nF)
            silu = g_nF * sig
            dh_nF = dy_nD @ wd.T
            dg_nF = dh_nF * u_nF * (sig * (1 + g_nF * (1 - sig)))
            du_nF = dh_nF * silu
            dx_nD = dg_nF @ wg.T + du_nF @ wu.T
            return (jax.lax.dynamic_update_slice_in_dim(dx, dx_nD, r0, 0), dwg_e + x_nD.T @ dg_nF,
                    dwu_e + x_nD.T @ du_nF, dwd_e + (silu * u_nF).T @ dy_nD)
        dx, dwg_e, dwu_e, dwd_e = _over_expert_blocks(
            blk_lo_E[e], blk_hi_E[e], b, rows, (dx, jnp.zeros_like(wg), jnp.zeros_like(wu), jnp.zeros_like(wd)))
        return (dx, jax.lax.dynamic_update_index_in_dim(dwg, dwg_e, e, 0),
                jax.lax.dynamic_update_index_in_dim(dwu, dwu_e, e, 0),
                jax.lax.dynamic_update_index_in_dim(dwd, dwd_e, e, 0))

    init = (jnp.zeros_like(x_RD), jnp.zeros_like(w_gate), jnp.zeros_like(w_up), jnp.zeros_like(w_down))
    dx, dwg, dwu, dwd = jax.lax.fori_loop(0, E, expert, init)
    return dx, dwg, dwu, dwd, None, None


_block_ffn.defvjp(_block_ffn_fwd, _block_ffn_bwd)


