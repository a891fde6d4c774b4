"""Shared helpers for pallas_kernels: impl name checks, shard_map (vma)
typing of kernel outputs and cotangents, argument checks, tiling, and the in-kernel pieces several
Mosaic kernels use (block-scale expansion, online-softmax step)."""
# Dim letters: KB = K / block scale blocks; tk/tm/tn tile sizes; G query rows, S key block (softmax).
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("xla", "pallas", "interpret", "reference", "ragged")
QUANTS = ("none", "mxfp8", "nvfp4", "int8")


def check_impl(impl: str, *, grouped: bool = False) -> str:
    """Validate a kernel path name: "xla", "pallas" (Mosaic, TPU), "interpret", "reference", or
    "ragged" (jax.lax.ragged_dot; the grouped matmuls only, grouped=True). Which one runs on a
    target is c2jax.ops' choice, not this package's."""
    names = IMPLS if grouped else tuple(i for i in IMPLS if i != "ragged")
    if impl not in names:
        raise ValueError(f"impl must be one of {names}, got impl={impl!r} (c2jax.ops chooses the implementation "
                         "for a target)")
    return impl


def check_quant(quant: str) -> str:
    """Validate a quant name."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got quant={quant!r}")
    return quant


def check_ndim(name: str, x, ndim: int, letters: str) -> None:
    """Raise ValueError naming `name` if x does not have `ndim` dims."""
    if jnp.ndim(x) != ndim:
        raise ValueError(f"{name} must have {ndim} dims [{letters}], got shape {jnp.shape(x)}")


def is_concrete(x) -> bool:
    """True if x holds a concrete value (not a tracer under jit/grad)."""
    try:
        np.asarray(x)
        return True
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return False


def round_up(x: int, m: int) -> int:
    """Smallest multiple of m that is >= x."""
    return (x + m - 1) // m * m


def pad_axis(x, axis: int, size: int, value=0):
    """Pad x along axis up to size with value (no-op when already that size)."""
    cur = x.shape[axis]
    if cur == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - cur)
    return jnp.pad(x, widths, constant_values=value)


def interpret_params(impl: str, *operands):
    """Value for pallas_call(interpret=...) given the concrete impl name and the kernel's operands."""
    if impl != "interpret":
        return False
    if varying_axes(*operands):
        # inside jax.shard_map: the generic interpreter cannot evaluate index maps over varying
        # scalar-prefetch operands (check_vma); the TPU interpreter can
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams()
    return True  # generic Pallas interpreter: several times faster than pltpu.InterpretParams on CPU


def varying_zeros(shape, dtype, *like):
    """jnp.zeros whose varying manual axes (inside jax.shard_map) are those of `like`'s arrays, so
    it can be a scan/loop carry or an aliased kernel output that is updated from them (no-op
    outside shard_map)."""
    return match_vma(jnp.zeros(shape, dtype), *like)


def match_vma(x, *like):
    """x made varying over every manual axis that x or any of `like` varies over (pcast)."""
    missing = varying_axes(*like) - _varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def out_struct(shape, dtype, *operands):
    """ShapeDtypeStruct for a pallas_call output: inside jax.shard_map (check_vma=True) the output
    varies over the union of the manual axes its operands vary over; ignored outside shard_map."""
    mat = jax.sharding.ManualAxisType(varying=varying_axes(*operands))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def cotangent_like(ct, primal):
    """Give a custom_vjp cotangent the varying manual axes of `primal`: sum it over the shard_map
    axes it varies over but `primal` does not (what autodiff does for the implicit broadcast of
    an invariant input), and mark it varying where only `primal` varies (no-op outside shard_map)."""
    ct_axes, primal_axes = _varying_axes(ct), _varying_axes(primal)
    extra = ct_axes - primal_axes
    if extra:
        ct = jax.lax.psum(ct, tuple(sorted(extra)))
    missing = primal_axes - ct_axes
    return jax.lax.pcast(ct, tuple(sorted(missing)), to="varying") if missing else ct


def varying_axes(*xs) -> frozenset:
    """Union of the manual mesh axes (inside jax.shard_map) that the arrays in xs vary over."""
    return frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(xs)))


def _varying_axes(x) -> frozenset:
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # jax >= 0.12; older releases: aval.vma
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(t, "vma", ()))


def pick_tile(dim: int, pref: int, align: int) -> int:
    """Largest multiple of `align` <= pref dividing dim; else pref clipped to dim rounded up to align."""
    if dim <= pref:
        return dim if dim % align == 0 or dim < align else (dim + align - 1) // align * align
    t = pref - pref % align
    while t >= align:
        if dim % t == 0:
            return t
        t -= align
    return pref


def quantized_tiles(m: int, k: int, n: int, tiling, blk: int):
    """(tm, tk, tn) for kernels reading 1-byte operands with block scales of `blk` along K:
    tm a multiple of 32 (int8/fp8 sublane packing), tk holding whole scale blocks."""
    tm, tk, tn = tiling
    return min(tm, round_up(m, 32)), pick_tile(k, tk, max(128, blk * 16)), pick_tile(n, tn, 128)


# ----------------------------------------------------------------------------- in-kernel helpers
# Traced inside Pallas kernel bodies (Mosaic on TPU, or the interpreter).

MASK_VALUE = -1e30


def expand_rows(s_KBN, blk):
    """[tk/blk, tn] block scales -> [tk, tn] by an exact 0/1 matmul (one nonzero per output)."""
    kb = s_KBN.shape[0]
    e = (jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (kb * blk, kb), 0), blk)
         == jax.lax.broadcasted_iota(jnp.int32, (kb * blk, kb), 1)).astype(jnp.bfloat16)
    return jnp.dot(e, s_KBN.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def expand_cols_t(s_KBM, blk):
    """[tk/blk, tm] transposed block scales -> [tm, tk] by an exact 0/1 matmul."""
    kb = s_KBM.shape[0]
    e = (jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (kb, kb * blk), 1), blk)
         == jax.lax.broadcasted_iota(jnp.int32, (kb, kb * blk), 0)).astype(jnp.bfloat16)
    return jax.lax.dot_general(s_KBM.astype(jnp.bfloat16), e, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def online_softmax_step(s_GS, mask_GS, v_ref, m_sc, l_sc, acc_sc):
    """One key block of an online softmax: update the running max m_sc, denominator l_sc and
    the f32 accumulator acc_sc ([G, E]) from scaled logits s_GS and the block's values v_ref."""
    s = jnp.where(mask_GS, s_GS, MASK_VALUE)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask_GS, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...],
                                                preferred_element_type=jnp.float32)
    m_sc[...] = m_new
