"""Quantized checkpoint formats: parse `quantization_config`, dequantize slices, quantize for save.

fp8 (DeepSeek-V3, Kimi K2): `quant_method: "fp8"`, `weight_block_size: [128, 128]`; each quantized
Linear `X.weight` is float8_e4m3fn [out, in] with a float32 `X.weight_scale_inv`
[ceil(out/128), ceil(in/128)] (edge blocks partial); w = float32(q) * scale_inv of its block.
Loaded weights are dequantized once, to the parameter dtype: c2jax's quantized paths
(c2jax.sampling.quantized, model.quant) use MXFP8 / int8 / NVFP4 with 32-element or per-channel
scales, not 128x128 blocks, so the block scales cannot be handed to them as they are; training
wants float weights anyway.

compressed-tensors pack-quantized INT4 (Kimi K2-Thinking / K2.5 routed experts): `X.weight_packed`
int32 [out, ceil(in/8)] holding 8 signed 4-bit values per word (value + 8 in bits 4i..4i+3 for
element i of the word), `X.weight_scale` [out, in/group] (bfloat16), `X.weight_shape` [2];
symmetric, w = q * scale of its group along the input dimension. There is no int4 kernel with
bf16 group scales in c2jax (NVFP4 has fp8 scales per 16), so these are dequantized once at load,
exactly: q * scale is computed in float32 (a 4-bit by 8-bit product fits), then cast.
"""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from c2jax.hf.errors import CheckpointError

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How a checkpoint's weights are quantized: method "none", "fp8" (block) or "int4" (packed)."""

    method: str = "none"
    block: tuple[int, int] = (128, 128)     # fp8 weight_block_size
    num_bits: int = 4                       # pack-quantized
    group_size: int = 32
    raw: dict | None = None                 # the quantization_config as read (written back on save)


def scheme_of(hf: dict) -> Scheme:
    """The Scheme of an HF config dict; CheckpointError naming any format c2jax cannot read."""
    q = hf.get("quantization_config")
    if not q:
        return Scheme()
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"fp8 checkpoint with fmt {q.get('fmt')!r}: only e4m3 is supported")
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise CheckpointError("fp8 checkpoint without a 2-D weight_block_size: only block-scaled fp8 "
                                  f"(weight_block_size [128, 128]) is supported, got {block!r}")
        return Scheme("fp8", block=(int(block[0]), int(block[1])), raw=q)
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt not in (None, "pack-quantized", "mixed-precision"):
            raise CheckpointError(f"compressed-tensors format {fmt!r} is not supported; c2jax reads pack-quantized")
        groups = q.get("config_groups") or {}
        for name, g in groups.items():
            gfmt = g.get("format") or fmt or "pack-quantized"
            if gfmt != "pack-quantized":
                raise CheckpointError(f"compressed-tensors format {gfmt!r} (group {name}) is not supported; "
                                      "c2jax reads pack-quantized")
            w = g.get("weights") or {}
            bad = {k: w.get(k) for k, want in (("type", "int"), ("symmetric", True), ("strategy", "group"))
                   if w.get(k) != want}
            if w.get("num_bits") not in (4, 8):
                bad["num_bits"] = w.get("num_bits")
            if g.get("input_activations") or (w.get("dynamic") not in (None, False)):
                bad["activations/dynamic"] = "quantized"
            if bad:
                raise CheckpointError(f"compressed-tensors group {name}: unsupported weight scheme {bad}; "
                                      "c2jax reads symmetric int4/int8 group-quantized weights")
        if not groups:
            raise CheckpointError("compressed-tensors quantization_config without config_groups")
        sizes = {(g["weights"]["num_bits"], g["weights"].get("group_size")) for g in groups.values()}
        if len(sizes) != 1:
            raise CheckpointError(f"compressed-tensors groups with different (num_bits, group_size) {sorted(sizes)}")
        (bits, gs), = sizes
        return Scheme("int4" if bits == 4 else "int8", num_bits=bits, group_size=int(gs), raw=q)
    raise CheckpointError(f"unsupported quant_method {method!r}; c2jax reads 'fp8' (block-scaled) and "
                          "'compressed-tensors' (pack-quantized int4/int8)")


# ----------------------------------------------------------------------------- fp8 blocks


def fp8_dequantize(q: np.ndarray, scale_inv: np.ndarray, block, rows: range, cols: range) -> np.ndarray:
    """float32 weights of the fp8 slice q (rows x cols of the full matrix) with block scales."""
    s_rows = scale_inv[np.arange(rows.start, rows.stop) // block[0] - rows.start // block[0]]
    s_full = s_rows[:, np.arange(cols.start, cols.stop) // block[1] - cols.start // block[1]]
    return q.astype(np.float32) * s_full.astype(np.float32)


def _exact_scale(amax_f32: np.ndarray) -> np.ndarray:
    """Block scales amax / 448 as float32; where a neighbouring float32 s gives 448 * s == amax
    exactly (a block that was dequantized from fp8 with that scale), that s, so that quantizing
    a loaded checkpoint again reproduces its scales bit for bit."""
    s = (amax_f32.astype(np.float64) / FP8_MAX).astype(np.float32)
    best = s.copy()
    for cand in (np.nextafter(s, np.float32(np.inf)), np.nextafter(s, np.float32(0)), s):
        hit = (np.float32(FP8_MAX) * cand).astype(np.float32) == amax_f32
        best = np.where(hit, cand, best)
    return np.where(amax_f32 > 0, best, np.float32(1.0)).astype(np.float32)


def fp8_quantize(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn [R, C], float32 scale_inv [ceil(R/b0), ceil(C/b1)]): DeepSeek's rule
    scale = amax / 448 per block, q = w / scale."""
    w = np.asarray(w, np.float32)
    R, C = w.shape
    b0, b1 = block
    nr, nc = math.ceil(R / b0), math.ceil(C / b1)
    pad = np.zeros((nr * b0, nc * b1), np.float32)
    pad[:R, :C] = np.abs(w)
    amax = pad.reshape(nr, b0, nc, b1).max(axis=(1, 3))
    s = _exact_scale(amax)
    s_full = np.repeat(np.repeat(s, b0, 0), b1, 1)[:R, :C]
    q = np.clip(w / s_full, -FP8_MAX, FP8_MAX).astype(FP8)
    return q, s


# ----------------------------------------------------------------------------- packed ints


def unpack_int(packed: np.ndarray, num_bits: int, cols: int) -> np.ndarray:
    """int8 [R, cols] from compressed-tensors int32 words [R, ceil(cols * bits / 32)] (dense,
    element i at bit i * bits, stored as value + 2**(bits-1))."""
    per = 32 // num_bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per, dtype=np.int64) * num_bits
    vals = (words[..., None] >> shifts) & ((1 << num_bits) - 1)
    vals = vals.reshape(packed.shape[0], -1)[:, :cols]
    return (vals - (1 << (num_bits - 1))).astype(np.int8)


def pack_int(q: np.ndarray, num_bits: int) -> np.ndarray:
    """The inverse of unpack_int: int32 words from int8 values in [-2**(bits-1), 2**(bits-1))."""
    per = 32 // num_bits
    R, C = q.shape
    u = np.zeros((R, math.ceil(C / per) * per), np.int64)
    u[:, :C] = q.astype(np.int64) + (1 << (num_bits - 1))
    shifts = np.arange(per, dtype=np.int64) * num_bits
    words = (u.reshape(R, -1, per) << shifts).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def int_dequantize(q: np.ndarray, scale: np.ndarray, group: int, cols: range) -> np.ndarray:
    """float32 weights of the int slice q [R, len(cols)] with group scales [R, G] (G from the
    group of cols.start on)."""
    g = np.arange(cols.start, cols.stop) // group - cols.start // group
    return q.astype(np.float32) * scale.astype(np.float32)[:, g]


def int_quantize(w: np.ndarray, num_bits: int, group: int, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """(int32 packed, scale [R, C/group]): symmetric min-max, scale = amax / ((2**bits - 1) / 2)
    as compressed-tensors' observer, q = clamp(round(w / scale))."""
    w = np.asarray(w, np.float32)
    R, C = w.shape
    if C % group:
        raise CheckpointError(f"cannot group-quantize a [{R}, {C}] weight in groups of {group}")
    amax = np.abs(w.reshape(R, C // group, group)).max(-1)
    scale = (amax / ((2 ** num_bits - 1) / 2)).astype(scale_dtype)
    s32 = np.where(scale.astype(np.float32) == 0, 1.0, scale.astype(np.float32))
    lo, hi = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    q = np.clip(np.round(w / np.repeat(s32, group, 1)), lo, hi).astype(np.int8)
    return pack_int(q, num_bits), scale
