"""pallas_kernels: Pallas kernels with their XLA paths and pure-jnp references, argument checks
and custom_vjps. They know no model and choose nothing: every entry point runs the path its
`impl=` names, "xla" | "pallas" (Mosaic, TPU) | "interpret" (the Pallas kernels run by the
interpreter, for CPU tests) | "reference" (pure jnp) | "ragged" (gmm / tgmm only:
jax.lax.ragged_dot, XLA's grouped matmul). Which path runs for a target is decided in one place,
c2jax.ops' registries.
"""
# Dim letters: M rows, K contraction, N output, G groups (experts), B batch, H q heads,
# Hk kv heads, L (query) length, S key / cache length, D q/k head dim, Dv v head dim.
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import (
    check_ndim,
    check_impl,
    check_quant,
    interpret_params,
)
from pallas_kernels.decode_attention import reference as _dec_ref
from pallas_kernels.decode_attention import tpu as _dec_tpu
from pallas_kernels.flash_attention import ops as _fa_ops
from pallas_kernels.gmm import ops as _gmm_ops
from pallas_kernels.gmm.ops import QuantizedExperts, quantize_experts
from pallas_kernels.qmatmul import reference as _qm_ref
from pallas_kernels.qmatmul import tpu as _qm_tpu
from pallas_kernels.qmatmul.reference import QuantizedWeight, quantize_weight
from pallas_kernels.quant import (
    dequantize_int8,
    dequantize_mxfp8,
    dequantize_nvfp4,
    fake_quant,
    quantize_int8,
    quantize_mxfp8,
    quantize_nvfp4,
)

__all__ = [
    "QuantizedExperts",
    "QuantizedWeight",
    "decode_attention",
    "mla_decode_attention",
    "dequantize_int8",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "fake_quant",
    "flash_attention",
    "gmm",
    "qmatmul",
    "quantize_experts",
    "quantize_int8",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_weight",
    "tgmm",
]


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, quant="none", preferred_element_type=jnp.float32,
        impl, tiling=None):
    """Grouped matmul out[m] = lhs[m] @ rhs[group(m)] for rows sorted by group; custom_vjp (MXFP8 backward if quantized).

    rhs_GKN may be a QuantizedExperts from quantize_experts (inference: weights stored quantized, forward only).
    """
    return _gmm_ops.gmm(lhs_MK, rhs_GKN, group_sizes_G, quant=quant,
                        preferred_element_type=preferred_element_type,
                        impl=check_impl(impl, grouped=True),
                        tiling=tiling)


def tgmm(lhs_MK, dy_MN, group_sizes_G, *, preferred_element_type=jnp.float32, impl, tiling=None):
    """Per-group weight gradient out[g] = lhs[rows of g]^T @ dy[rows of g] -> [G,K,N]."""
    return _gmm_ops.tgmm(lhs_MK, dy_MN, group_sizes_G, preferred_element_type=preferred_element_type,
                         impl=check_impl(impl, grouped=True), tiling=tiling)


def _check_ids(name, x, b, length, letters):
    check_ndim(name, x, 2, letters)
    if tuple(x.shape) != (b, length):
        raise ValueError(f"{name} shape {tuple(x.shape)} must be ({letters}) = {(b, length)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer (int32), got {x.dtype}")


def _attention_masks(q_BHLD, k_BHSD, segment_ids_BL, q_segment_ids_BL, kv_segment_ids_BS,
                     q_positions_BL, kv_positions_BS, causal):
    """Validate the mask arguments; returns (q_seg, kv_seg, q_pos, kv_pos), each None or int32."""
    b, _, lq, _ = q_BHLD.shape
    lk = k_BHSD.shape[2]
    q_seg, kv_seg = q_segment_ids_BL, kv_segment_ids_BS
    if segment_ids_BL is not None:
        if q_seg is not None or kv_seg is not None:
            raise ValueError("pass segment_ids_BL (same ids for queries and keys) or q_segment_ids_BL with "
                             "kv_segment_ids_BS, not both")
        if lq != lk:
            raise ValueError(f"segment_ids_BL needs Lq == Lk (got {lq}, {lk}); pass q_segment_ids_BL and "
                             "kv_segment_ids_BS instead")
        q_seg = kv_seg = segment_ids_BL
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass both q_segment_ids_BL and kv_segment_ids_BS, or neither")
    if (q_positions_BL is None) != (kv_positions_BS is None):
        raise ValueError("pass both q_positions_BL and kv_positions_BS, or neither")
    if q_seg is not None:
        _check_ids("q_segment_ids_BL" if segment_ids_BL is None else "segment_ids_BL", q_seg, b, lq, "B, L")
        _check_ids("kv_segment_ids_BS" if segment_ids_BL is None else "segment_ids_BL", kv_seg, b, lk, "B, S")
        q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
    q_pos = kv_pos = None
    if q_positions_BL is not None:
        if not causal:
            raise ValueError("q_positions_BL / kv_positions_BS define the causal mask: pass causal=True with "
                             "them (or drop them for non-causal attention)")
        _check_ids("q_positions_BL", q_positions_BL, b, lq, "B, L")
        _check_ids("kv_positions_BS", kv_positions_BS, b, lk, "B, S")
        q_pos, kv_pos = q_positions_BL.astype(jnp.int32), kv_positions_BS.astype(jnp.int32)
    elif causal and lq != lk:
        raise ValueError(f"causal attention with Lq={lq} != Lk={lk} needs q_positions_BL and kv_positions_BS "
                         "(which keys each query sees)")
    return q_seg, kv_seg, q_pos, kv_pos


def _check_attn(q_BHLD, k_BHSD, v_BHSDv):
    check_ndim("q_BHLD", q_BHLD, 4, "B, H, L, D")
    check_ndim("k_BHSD", k_BHSD, 4, "B, Hk, S, D")
    check_ndim("v_BHSDv", v_BHSDv, 4, "B, Hk, S, Dv")
    b, h, _, d = q_BHLD.shape
    if k_BHSD.shape[0] != b or k_BHSD.shape[3] != d:
        raise ValueError(f"k_BHSD shape {k_BHSD.shape} does not fit q_BHLD {q_BHLD.shape} (need same B, D)")
    if v_BHSDv.shape[:3] != k_BHSD.shape[:3]:
        raise ValueError(f"v_BHSDv shape {v_BHSDv.shape} must match k_BHSD {k_BHSD.shape} in B, Hk, S")
    if h % k_BHSD.shape[1]:
        raise ValueError(f"q heads H={h} must be a multiple of kv heads Hk={k_BHSD.shape[1]} (k_BHSD)")


def flash_attention(q_BHLD, k_BHSD, v_BHSDv, *, segment_ids_BL=None, q_segment_ids_BL=None,
                    kv_segment_ids_BS=None, q_positions_BL=None, kv_positions_BS=None, causal=True,
                    sm_scale=None, impl, block_sizes=None):
    """Attention with segment and causal masks (by index, or key s seen by query l when kv_pos[s] <= q_pos[l]);
    Lq != Lk with positions; GQA (Hk divides H) and MLA (D != Dv) shapes; differentiable."""
    _check_attn(q_BHLD, k_BHSD, v_BHSDv)
    masks = _attention_masks(q_BHLD, k_BHSD, segment_ids_BL, q_segment_ids_BL, kv_segment_ids_BS,
                             q_positions_BL, kv_positions_BS, causal)
    d = q_BHLD.shape[3]
    scale = float(d ** -0.5 if sm_scale is None else sm_scale)
    if block_sizes is not None and len(block_sizes) != 4:
        raise ValueError(f"block_sizes must be (block_q, block_k, bwd_block_q, bwd_block_k), got {block_sizes}")
    return _fa_ops.flash_attention_op(q_BHLD, k_BHSD, v_BHSDv, *masks, causal=causal, scale=scale,
                                      impl=check_impl(impl),
                                      blocks=tuple(block_sizes) if block_sizes else _fa_ops.DEFAULT_BLOCKS)


def decode_attention(q_BHD, k_cache_BHSD, v_cache_BHSDv, lengths_B, *, sm_scale=None, impl, block_s=_dec_tpu.DEFAULT_BLOCK_S, cache_layout="BHSD"):
    """One new query token per row against a ragged KV cache (positions >= lengths[b] masked).
    cache_layout "BSHD": the caches are [B, S, Hk, D] (a model's cache layout); the TPU kernel
    reads them in place when each head's D fills whole 128-lane tiles."""
    if cache_layout not in ("BHSD", "BSHD"):
        raise ValueError(f"cache_layout must be 'BHSD' or 'BSHD', got {cache_layout!r}")
    letters = "B, Hk, S, D" if cache_layout == "BHSD" else "B, S, Hk, D"
    check_ndim("q_BHD", q_BHD, 3, "B, H, D")
    check_ndim("k_cache", k_cache_BHSD, 4, letters)
    check_ndim("v_cache", v_cache_BHSDv, 4, letters.replace("D", "Dv"))
    check_ndim("lengths_B", lengths_B, 1, "B")
    if cache_layout == "BSHD":
        as_bhsd = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
        kk, vv = jax.eval_shape(as_bhsd, k_cache_BHSD), jax.eval_shape(as_bhsd, v_cache_BHSDv)
    else:
        kk, vv = k_cache_BHSD, v_cache_BHSDv
    b, h, d = q_BHD.shape
    if kk.shape[0] != b or kk.shape[3] != d:
        raise ValueError(f"k_cache shape {k_cache_BHSD.shape} ({cache_layout}) does not fit q_BHD {q_BHD.shape}")
    if vv.shape[:3] != kk.shape[:3]:
        raise ValueError(f"v_cache shape {v_cache_BHSDv.shape} must match k_cache in B, Hk, S")
    if h % kk.shape[1]:
        raise ValueError(f"q heads H={h} must be a multiple of kv heads {kk.shape[1]} (k_cache)")
    if lengths_B.shape[0] != b:
        raise ValueError(f"lengths_B has {lengths_B.shape[0]} entries, batch is {b}")
    scale = float(d ** -0.5 if sm_scale is None else sm_scale)
    impl = check_impl(impl)
    if impl in ("reference", "xla"):
        if cache_layout == "BSHD":
            k_cache_BHSD, v_cache_BHSDv = k_cache_BHSD.transpose(0, 2, 1, 3), v_cache_BHSDv.transpose(0, 2, 1, 3)
        return _dec_ref.decode_attention_reference(q_BHD, k_cache_BHSD, v_cache_BHSDv, lengths_B, scale)
    return _dec_tpu.decode_attention_tpu(q_BHD, k_cache_BHSD, v_cache_BHSDv, lengths_B, sm_scale=scale,
                                         block_s=block_s,
                                         interpret=interpret_params(impl, q_BHD, k_cache_BHSD, lengths_B),
                                         cache_layout="BSKD" if cache_layout == "BSHD" else "BKSD")


def mla_decode_attention(q_latent_BHC, q_rope_BHR, latent_BSC, k_rope_BSR, lengths_B, *, sm_scale, impl, block_s=_dec_tpu.DEFAULT_BLOCK_S):
    """MLA decode over a latent cache (one query per row; positions >= lengths[b] masked): each
    head's latent context [B, H, C] (values are the latents; the caller applies the up-projection)."""
    check_ndim("q_latent_BHC", q_latent_BHC, 3, "B, H, C")
    check_ndim("q_rope_BHR", q_rope_BHR, 3, "B, H, R")
    check_ndim("latent_BSC", latent_BSC, 3, "B, S, C")
    check_ndim("k_rope_BSR", k_rope_BSR, 3, "B, S, R")
    check_ndim("lengths_B", lengths_B, 1, "B")
    (b, h, c), r = q_latent_BHC.shape, q_rope_BHR.shape[2]
    if q_rope_BHR.shape[:2] != (b, h):
        raise ValueError(f"q_rope_BHR shape {q_rope_BHR.shape} does not fit q_latent_BHC {q_latent_BHC.shape}")
    if latent_BSC.shape[0] != b or latent_BSC.shape[2] != c:
        raise ValueError(f"latent_BSC shape {latent_BSC.shape} does not fit q_latent_BHC {q_latent_BHC.shape}")
    if k_rope_BSR.shape != (b, latent_BSC.shape[1], r):
        raise ValueError(f"k_rope_BSR shape {k_rope_BSR.shape} must be {(b, latent_BSC.shape[1], r)}")
    if lengths_B.shape[0] != b:
        raise ValueError(f"lengths_B has {lengths_B.shape[0]} entries, batch is {b}")
    impl = check_impl(impl)
    if impl in ("reference", "xla"):
        return _dec_ref.mla_decode_attention_reference(q_latent_BHC, q_rope_BHR, latent_BSC, k_rope_BSR, lengths_B,
                                                       float(sm_scale))
    return _dec_tpu.mla_decode_attention_tpu(q_latent_BHC, q_rope_BHR, latent_BSC, k_rope_BSR, lengths_B,
                                             sm_scale=float(sm_scale), block_s=block_s,
                                             interpret=interpret_params(impl, q_latent_BHC, latent_BSC, lengths_B))


def qmatmul(x_MK, w, *, quant="int8", mode="weight_only", preferred_element_type=jnp.float32,
            impl, tiling=None):
    """x @ w with quantized weights (w: float [K,N] or QuantizedWeight) and optionally quantized activations."""
    check_ndim("x_MK", x_MK, 2, "M, K")
    if mode not in _qm_ref.MODES:
        raise ValueError(f"mode must be one of {_qm_ref.MODES}, got mode={mode!r}")
    if isinstance(w, QuantizedWeight):
        quant = w.quant
    check_quant(quant)
    if quant == "none":
        raise ValueError("qmatmul needs quant in int8|mxfp8|nvfp4 (got quant='none'); use jnp.dot")
    w_shape = w.values_KN.shape if isinstance(w, QuantizedWeight) else jnp.shape(w)
    if len(w_shape) != 2 or w_shape[0] != x_MK.shape[1]:
        raise ValueError(f"w must be [K, N] with K={x_MK.shape[1]} (x_MK), got shape {w_shape}")
    blk = _qm_ref.block_of(quant)
    if x_MK.shape[1] % blk:
        raise ValueError(f"quant={quant!r} needs K divisible by {blk}; x_MK has K={x_MK.shape[1]}")
    if not isinstance(w, QuantizedWeight):
        w = quantize_weight(w, quant)
    impl = check_impl(impl)
    if impl in ("reference", "xla"):
        return _qm_ref.qmatmul_reference(x_MK, w, mode, preferred_element_type)
    return _qm_tpu.qmatmul_tpu(x_MK, w, mode, preferred_element_type=preferred_element_type,
                               tiling=tiling or _qm_tpu.DEFAULT_TILING,
                               interpret=interpret_params(impl, x_MK, w))


