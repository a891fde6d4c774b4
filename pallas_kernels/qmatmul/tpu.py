"""Pallas TPU (Mosaic) quantized matmul with dequantization fused into the tile loop.

Quantized tiles (int8, E4M3, E2M1 as int8 codes) are read from HBM at 1 byte/value; block
scales are expanded in VMEM with a 0/1 matmul (exact) and the MXU sees exact bf16 operands
(int8 x int8 -> int32 for int8 weight+activation). FP32 per-token / per-channel scales are
applied once to the accumulator.
"""
# Dim letters: M rows, K contraction, N output channels, KB = K / block; tm/tk/tn tile sizes.
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import quant as Q
from pallas_kernels.cost import gmm_cost
from pallas_kernels._common import (
    expand_cols_t,
    expand_rows,
    out_struct,
    pad_axis,
    quantized_tiles,
    round_up,
)
from pallas_kernels.qmatmul.reference import (
    QuantizedWeight,
    block_of,
    quantize_activation,
)

DEFAULT_TILING = (256, 512, 512)  # (tm, tk, tn); untuned guesses until TPU time is available
VMEM_LIMIT_BYTES = 32 * 1024 * 1024


def _kernel(*refs, quant, mode, nk, has_xs, has_ws, has_row, has_col, int_acc):
    it = iter(refs)
    x_ref = next(it)
    xs_ref = next(it) if has_xs else None
    w_ref = next(it)
    ws_ref = next(it) if has_ws else None
    row_ref = next(it) if has_row else None
    col_ref = next(it) if has_col else None
    o_ref, acc_ref = next(it), next(it)
    k = pl.program_id(2)
    blk = block_of(quant)
    code_scale = 0.5 if quant == "nvfp4" else 1.0  # E2M1 arrives as int8 codes = 2 * value

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if int_acc:
        acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.int32)
    else:
        w = w_ref[...].astype(jnp.float32)
        if has_ws:
            w = w * (expand_rows(ws_ref[...], blk) * code_scale)
        x = x_ref[...].astype(jnp.float32)
        if has_xs:
            x = x * (expand_cols_t(xs_ref[...], blk) * code_scale)
        acc_ref[...] += jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                preferred_element_type=jnp.float32)

    @pl.when(k == nk - 1)
    def _():
        out = acc_ref[...].astype(jnp.float32)
        if has_row:
            out = out * row_ref[...]
        if has_col:
            out = out * col_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def _codes(values, quant):
    return Q.nvfp4_codes(values) if quant == "nvfp4" else values


def qmatmul_tpu(x_MK, w: QuantizedWeight, mode: str, *, preferred_element_type=jnp.float32,
                tiling=DEFAULT_TILING, interpret=False):
    """Quantized matmul x @ w with fused dequantization (TPU kernel)."""
    quant = w.quant
    m, k = x_MK.shape
    n = w.values_KN.shape[1]
    blk = block_of(quant)
    tm, tk, tn = quantized_tiles(m, k, n, tiling, blk)
    mp, kp, np_ = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    args, specs = [], []
    row = None
    if mode == "weight_only":
        args.append(pad_axis(pad_axis(x_MK.astype(jnp.bfloat16), 0, mp), 1, kp))
        specs.append(pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)))
        has_xs = False
    else:
        xv, xs, row = quantize_activation(x_MK, quant)
        args.append(pad_axis(pad_axis(_codes(xv, quant), 0, mp), 1, kp))
        specs.append(pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)))
        has_xs = xs is not None
        if has_xs:
            args.append(pad_axis(pad_axis(xs.T.astype(jnp.bfloat16), 0, kp // blk), 1, mp))
            specs.append(pl.BlockSpec((tk // blk, tm), lambda i, j, kk: (kk, i)))
    args.append(pad_axis(pad_axis(_codes(w.values_KN, quant), 0, kp), 1, np_))
    specs.append(pl.BlockSpec((tk, tn), lambda i, j, kk: (kk, j)))
    has_ws = w.block_scales_KBN is not None
    if has_ws:
        args.append(pad_axis(pad_axis(w.block_scales_KBN.astype(jnp.bfloat16), 0, kp // blk), 1, np_))
        specs.append(pl.BlockSpec((tk // blk, tn), lambda i, j, kk: (kk, j)))
    has_row = row is not None
    if has_row:
        args.append(pad_axis(row.astype(jnp.float32)[:, None], 0, mp))
        specs.append(pl.BlockSpec((tm, 1), lambda i, j, kk: (i, 0)))
    has_col = w.channel_scale_N is not None
    if has_col:
        args.append(pad_axis(w.channel_scale_N.astype(jnp.float32)[None, :], 1, np_))
        specs.append(pl.BlockSpec((1, tn), lambda i, j, kk: (0, j)))
    int_acc = quant == "int8" and mode == "weight_act"
    nk = kp // tk
    out = pl.pallas_call(
        functools.partial(_kernel, quant=quant, mode=mode, nk=nk, has_xs=has_xs, has_ws=has_ws,
                          has_row=has_row, has_col=has_col, int_acc=int_acc),
        grid=(mp // tm, np_ // tn, nk),
        in_specs=specs,
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        out_shape=out_struct((mp, np_), preferred_element_type, *args),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.int32 if int_acc else jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=gmm_cost(m, k, n, 1, args[0].dtype, w.values_KN.dtype, preferred_element_type,
                               tiling=(tm, tk, tn)),
        interpret=interpret,
    )(*args)
    return out[:m, :n]
