"""Attention ops: `attention` (training and prefill self-attention over packed rows) and
`decode_attention` (a few new queries per row against a KV cache), each one registry.

Under a context-parallel mesh (the layout of c2jax.parallel.context) c2jax.ops.attention_cp
runs, and the chosen implementation attends each rank's queries against the gathered keys by explicit positions and
segments (the flash kernel, or XLA's masked product in query chunks); on other multi-device
meshes a Mosaic kernel runs inside a shard_map over the batch axes (GSPMD cannot partition a
custom call).

Letters: B batch, L query length, S key length (cache slots), H query heads, G kv heads, P q/k
head dim, O value dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from c2jax.ops import attention_xla as xla
from c2jax.ops.attention_xla import DECODE_MAX_QUERIES, attention_mask
from c2jax.ops.registry import define_op, kernels_choice
from c2jax.ops.target import Target, current_target, narrow_vectors, one_cpu_device
from c2jax.ops import attention_cp as cp
from c2jax.parallel.context import cp_active, cp_impl
from c2jax.parallel.mesh import row_axes, spec_entry

ATTENTION = define_op("attention", {
    "tpu": ("pallas_flash", "xla_blocked"),
    "cpu": ("cpu_ffi", "xla_blocked"),
    # GPU: cuDNN's fused attention where its shapes allow (bf16/fp16, equal q/k and v head dims)
    "gpu": ("cudnn", "xla_blocked"),
})
# MLA with a latent cache (prefill and decode): the up-projection absorbed into query and output
MLA_CACHE_ATTENTION = define_op("mla_cache_attention", {"tpu": ("pallas", "xla_absorbed"), "*": ("xla_absorbed",)})
DECODE_ATTENTION = define_op("decode_attention", {
    "tpu": ("pallas", "xla"),
    # XLA CPU copies each layer's K/V cache transposed for the batched-matmul form at every step
    "cpu": ("xla_reduce", "xla"),
    "gpu": ("xla",),
})


# ----------------------------------------------------------------------------- training / prefill


def _not_cp(spec):
    return "the packed-row form only (context parallelism attends gathered keys)" if spec["cp"] else None


def _flash_cp_ok(target: Target, **spec):
    return "ring context parallelism (mesh.cp_impl='ring') runs its own XLA online softmax" \
        if spec["cp"] and spec.get("ring") else None


def _flash_ok(target: Target, **spec):
    if target.platform != "tpu":
        return f"a Mosaic kernel (target is {target.platform})"
    return _flash_cp_ok(target, **spec)


def _cpu_attention_ok(target: Target, **spec):
    why = one_cpu_device(target) or _not_cp(spec)
    if why:
        return why
    from c2jax.backends.cpu import attention as cpu_attention
    return cpu_attention.usable(spec["q"], spec["k"], spec["v"])


@ATTENTION.register("xla_blocked", doc="query blocks over the keys up to each block (half the L x L scores)")
def _xla_blocked(q, k, v, positions_BL, segment_ids_BL, scale):
    return xla.causal_block_attention(q, k, v, positions_BL, segment_ids_BL, scale)


@ATTENTION.register("xla_dense", lambda target, **spec: _not_cp(spec), doc="the full masked L x L product")
def _xla_dense(q, k, v, positions_BL, segment_ids_BL, scale):
    mask = attention_mask(positions_BL, positions_BL, segment_ids_BL, segment_ids_BL)
    return xla.dot_product_attention(q, k, v, mask, scale)


@ATTENTION.register("cpu_ffi", _cpu_attention_ok, doc="c2jax/backends/cpu/cpu_attention.cc, forward and backward",
                    auto_skip=narrow_vectors)
def _cpu_ffi(q, k, v, positions_BL, segment_ids_BL, scale):
    from c2jax.backends.cpu import attention as cpu_attention
    return cpu_attention.causal_attention(q, k, v, positions_BL, segment_ids_BL, scale).astype(q.dtype)


def _cudnn_ok(target: Target, **spec):
    if target.platform != "gpu":
        return f"cuDNN runs on GPU (target is {target.platform})"
    return _not_cp(spec) or _sdpa_shapes(spec["q"], spec["v"])


def _sdpa_shapes(q, v):
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bf16/fp16 (got {q.dtype})"
    if q.shape[-1] != v.shape[-1] or q.shape[-1] % 8 or q.shape[-1] > 128:
        return f"cuDNN attention needs equal q/k and v head dims, a multiple of 8, <= 128 (got {q.shape[-1]}, " \
               f"{v.shape[-1]})"
    return None


def _sdpa(implementation: str):
    def run(q, k, v, positions_BL, segment_ids_BL, scale):
        mask_B1LL = attention_mask(positions_BL, positions_BL, segment_ids_BL, segment_ids_BL)[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask_B1LL, scale=scale, implementation=implementation)
    return run


ATTENTION.register("cudnn", _cudnn_ok, doc="jax.nn.dot_product_attention on cuDNN (fused, forward and backward)")(
    _sdpa("cudnn"))
ATTENTION.register("xla_sdpa", lambda target, **spec: _not_cp(spec),
                   doc="jax.nn.dot_product_attention's XLA form, the cuDNN path's mask and layout (tests on CPU)")(
    _sdpa("xla"))


def _flash_call(impl: str, q, k, v, scale, **masks):
    """pallas_kernels.flash_attention (causal) on [B, L, H, P]-layout operands -> [B, L, H, O]."""
    import pallas_kernels
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    return t(pallas_kernels.flash_attention(t(q), t(k), t(v), causal=True, sm_scale=scale, impl=impl, **masks))


def _flash(impl: str):
    return lambda q, k, v, positions_BL, segment_ids_BL, scale: _flash_call(
        impl, q, k, v, scale, segment_ids_BL=segment_ids_BL)


ATTENTION.register("pallas_flash", _flash_ok, doc="Pallas Mosaic flash attention, forward and backward")(_flash("pallas"))
ATTENTION.register("pallas_flash_interpret", _flash_cp_ok,
                   doc="the flash kernel run by the Pallas interpreter (tests on CPU)")(_flash("interpret"))


def _flash_gathered(impl: str):
    """Local queries [b, Lc, H, P] against gathered keys [b, S, G, P]: the flash kernel with the
    queries' and keys' own positions and segments (zigzag order needs no special case)."""
    return lambda q, k_S, v_S, pos, pos_S, seg, seg_S, scale: _flash_call(
        impl, q, k_S, v_S, scale, q_segment_ids_BL=seg, kv_segment_ids_BS=seg_S, q_positions_BL=pos,
        kv_positions_BS=pos_S)


# the local attention each implementation runs under context parallelism (others: XLA's masked product)
_GATHERED = {"pallas_flash": _flash_gathered("pallas"), "pallas_flash_interpret": _flash_gathered("interpret")}


def _select(kernels, L: int, **operands):
    target = current_target()
    cp_on = cp_active(L)
    ring = cp_on and cp_impl() == "ring"
    impl = ATTENTION.select(kernels_choice(kernels, "attention"), target, cp=cp_on, ring=ring, **operands)
    return impl, target, cp_on, _GATHERED.get(impl.name, cp.masked_local_attention)


def attention(kernels, q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL, scale: float):
    """Causal self-attention of packed rows (keys = the queries' own row) by position and segment
    -> [B, L, H, O]. kernels: the model config's `kernels` section."""
    impl, target, cp_on, local = _select(kernels, q_BLHP.shape[1], q=q_BLHP, k=k_BLGP, v=v_BLGO)
    if cp_on:
        return cp.gqa_context_attention(q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL, scale, local=local)
    return _run(impl, target, scale, q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL)


def mla_context_attention(kernels, q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                          segment_ids_BL, scale: float, dtype):
    """MLA training attention under context parallelism (c2jax.ops.attention_cp gathers the
    latents and up-projects them per rank) with the chosen local attention -> [B, L, H, O]."""
    B, L, H, N = q_nope_BLHN.shape
    R, O = q_rope_BLHR.shape[-1], kv_b_CHX.shape[-1] - N
    shape = lambda *d: jax.ShapeDtypeStruct(d, dtype)  # noqa: E731
    _, _, _, local = _select(kernels, L, q=shape(B, L, H, N + R), k=shape(B, L, H, N + R), v=shape(B, L, H, O))
    return cp.mla_context_attention(q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                                    segment_ids_BL, scale, dtype, local=local)


def _run(impl, target: Target, scale: float, *rows):
    """impl.fn(*rows, scale); a Mosaic kernel over a multi-device mesh runs inside a shard_map over
    the rows' batch axes (rows attend independently; GSPMD cannot partition a custom call)."""
    return _per_rows(lambda *r: impl.fn(*r, scale), impl.name.startswith("pallas") and target.devices > 1, *rows)


def _per_rows(fn, shard: bool, *rows):
    """fn(*rows), inside a shard_map over the rows' batch axes when `shard` (the output is one row array)."""
    if not shard:
        return fn(*rows)
    b_axes = spec_entry(row_axes(rows[0].shape[0]))
    specs = tuple(P(b_axes, *([None] * (r.ndim - 1))) for r in rows)
    return jax.shard_map(fn, in_specs=specs, out_specs=specs[0])(*rows)


# ----------------------------------------------------------------------------- decode


def _one_query(target: Target, **spec):
    return None if spec["L"] == 1 else f"one query per row (got {spec['L']})"


def _decode_pallas_ok(target: Target, **spec):
    if target.platform != "tpu":
        return f"a Mosaic kernel (target is {target.platform})"
    return _one_query(target, **spec)


@DECODE_ATTENTION.register("xla", doc="masked batched matmuls over the cache")
def _decode_xla(q, k, v, positions_BL, scale):
    B, S = k.shape[:2]
    return xla.dot_product_attention(q, k, v, attention_mask(positions_BL, _slots(B, S)), scale)


@DECODE_ATTENTION.register("xla_reduce", lambda target, **spec: None if spec["L"] <= DECODE_MAX_QUERIES else
                           f"at most {DECODE_MAX_QUERIES} queries per row (got {spec['L']})",
                           doc="f32 multiply-reduce on the cache's own [B, S, G, P] layout")
def _decode_reduce(q, k, v, positions_BL, scale):
    B, S = k.shape[:2]
    return xla.decode_attention_reduce(q, k, v, attention_mask(positions_BL, _slots(B, S)), scale)


def _decode_pallas(impl: str):
    def run(q, k, v, positions_BL, scale):
        import pallas_kernels
        S = k.shape[1]
        lengths_B = jax.numpy.clip(positions_BL[:, 0] + 1, 0, S).astype(jax.numpy.int32)
        out = pallas_kernels.decode_attention(q[:, 0], k, v, lengths_B, sm_scale=scale, impl=impl,
                                              cache_layout="BSHD")   # the cache's own layout, read in place
        return out[:, None]
    return run


DECODE_ATTENTION.register("pallas", _decode_pallas_ok, doc="Pallas Mosaic decode attention (one query per row)")(
    _decode_pallas("pallas"))
DECODE_ATTENTION.register("pallas_interpret", _one_query,
                          doc="the decode kernel run by the Pallas interpreter (tests on CPU)")(
    _decode_pallas("interpret"))


def _slots(B: int, S: int):
    return jax.numpy.broadcast_to(jax.numpy.arange(S, dtype=jax.numpy.int32), (B, S))


def decode_attention(kernels, q_BLHP, k_BSGP, v_BSGO, positions_BL, scale: float):
    """Queries at positions_BL attend cache slots [0, position] (slot index == position) -> [B, L, H, O]."""
    target = current_target()
    impl = DECODE_ATTENTION.select(kernels_choice(kernels, "decode_attention"), target, L=q_BLHP.shape[1])
    return _run(impl, target, scale, q_BLHP, k_BSGP, v_BSGO, positions_BL)


MLA_CACHE_ATTENTION.register("xla_absorbed", doc="XLA: queries absorbed into the latent space, no per-head K/V")(
    lambda target, *args: xla.mla_absorbed_attention(*args))


def _mla_cache_pallas(impl: str):
    def run(target, q_nope_BLHN, q_rope_BLHR, latent_BSC, k_rope_BSR, kv_b_CHX, positions_BL, scale, dt):
        import pallas_kernels

        def kernel(q_latent_BHC, q_rope_BHR, lat_BSC, rope_BSR, lengths_B):
            return pallas_kernels.mla_decode_attention(q_latent_BHC, q_rope_BHR, lat_BSC, rope_BSR, lengths_B,
                                                       sm_scale=scale, impl=impl)
        N, S = q_nope_BLHN.shape[-1], latent_BSC.shape[1]
        cdt = latent_BSC.dtype   # the kernel reads the cache in place, in its own dtype
        q_latent_BHC = jnp.einsum("bhn,chn->bhc", q_nope_BLHN[:, 0], kv_b_CHX[..., :N]).astype(cdt)
        lengths_B = jnp.clip(positions_BL[:, 0] + 1, 0, S).astype(jnp.int32)
        ctx_BHC = _per_rows(kernel, target.devices > 1, q_latent_BHC, q_rope_BLHR[:, 0].astype(k_rope_BSR.dtype),
                            latent_BSC, k_rope_BSR, lengths_B)
        return jnp.einsum("bhc,cho->bho", ctx_BHC.astype(dt), kv_b_CHX[..., N:].astype(dt))[:, None]
    return run


MLA_CACHE_ATTENTION.register("pallas", _decode_pallas_ok,
                             doc="Pallas Mosaic MLA decode in the latent space (one query per row)")(
    _mla_cache_pallas("pallas"))
MLA_CACHE_ATTENTION.register("pallas_interpret", _one_query,
                             doc="the MLA decode kernel run by the Pallas interpreter (tests on CPU)")(
    _mla_cache_pallas("interpret"))


def mla_cache_attention(kernels, q_nope_BLHN, q_rope_BLHR, latent_BSC, k_rope_BSR, kv_b_CHX, positions_BL,
                        scale: float, dtype):
    """MLA queries against a latent cache (slot index == position) -> [B, L, H, O]."""
    target = current_target()
    impl = MLA_CACHE_ATTENTION.select(kernels_choice(kernels, "mla_cache_attention"), target,
                                      L=q_nope_BLHN.shape[1])
    return impl.fn(target, q_nope_BLHN, q_rope_BLHR, latent_BSC, k_rope_BSR, kv_b_CHX, positions_BL, scale, dtype)


def write_cache(cache_BS_, new_BL_, positions_BL):
    """Write new entries into cache rows at their positions (out-of-range positions dropped)."""
    return xla.write_cache(cache_BS_, new_BL_, positions_BL, per_entry=current_target().platform == "cpu")


# ----------------------------------------------------------------------------- the attention layers' paths
# Which way a GQA or MLA layer attends follows from the call: a KV cache or none, how many queries
# a row brings, and the mesh (context parallelism). Each path is an implementation of its own op,
# chosen by these facts alone (no config field), recorded like every choice; inside it the kernel
# ops above pick the kernels.

_PATH_FIELD = "the call (cache, queries per row, mesh)"
GQA_ATTENTION = define_op("gqa_attention", {"*": ("context_prefill", "cache_decode", "cache_prefill",
                                                  "context_parallel", "packed")}, field=_PATH_FIELD)
MLA_ATTENTION = define_op("mla_attention", {"*": ("context_prefill", "latent_cache", "context_parallel",
                                                  "packed")}, field=_PATH_FIELD)


def _path(*, cache: bool, cp: bool | None = None, decode: bool | None = None):
    """supported() of a path: the call has (cache) or lacks a cache, runs under context
    parallelism (cp; None: either way) and brings at most DECODE_MAX_QUERIES queries (decode)."""
    def ok(target: Target, **spec):
        if spec["cache"] != cache:
            return "a KV cache path" if cache else "the path without a KV cache"
        if cp is not None and spec["cp"] != cp:
            return "context parallelism on the mesh" if cp else "no context-parallel mesh"
        if decode is not None and (spec["L"] <= DECODE_MAX_QUERIES) != decode:
            return f"at most {DECODE_MAX_QUERIES} queries per row" if decode else \
                f"more than {DECODE_MAX_QUERIES} queries per row"
        return None
    return ok


def _path_spec(L: int, cache) -> dict:
    has_cache = cache is not None
    return dict(L=L, cache=has_cache, cp=cp.cp_prefill_active(L) if has_cache else cp_active(L))


def gqa_attention(kernels, q_BLHP, k_BLGP, v_BLGP, positions_BL, segment_ids_BL, scale: float, dtype,
                  cache=None, span: int | None = None):
    """GQA attention of new tokens -> (out [B, L, H, P], the updated cache {"k", "v"} or None).
    Without a cache: causal self-attention of packed rows (under context parallelism its context
    path). With a cache: the new K/V written at their positions (slot index == position), then
    the queries attend slots [0, span) (span static, None = all): decode for a few queries per
    row, a masked prefill for more, the context-parallel prefill under a context axis."""
    impl = GQA_ATTENTION.select("auto", current_target(), **_path_spec(q_BLHP.shape[1], cache))
    return impl.fn(kernels, q_BLHP, k_BLGP, v_BLGP, positions_BL, segment_ids_BL, scale, dtype, cache, span)


@GQA_ATTENTION.register("packed", _path(cache=False, cp=False), doc="the attention op over packed rows")
@GQA_ATTENTION.register("context_parallel", _path(cache=False, cp=True),
                        doc="the attention op's context-parallel form (c2jax.ops.attention_cp)")
def _gqa_self(kernels, q, k, v, positions_BL, segment_ids_BL, scale, dtype, cache, span):
    return attention(kernels, q, k, v, positions_BL, segment_ids_BL, scale), None


@GQA_ATTENTION.register("context_prefill", _path(cache=True, cp=True),
                        doc="CP prefill: gather the new K/V, write the cache, attend the local queries")
def _gqa_context_prefill(kernels, q, k, v, positions_BL, segment_ids_BL, scale, dtype, cache, span):
    out, ck, cv = cp.gqa_context_prefill(q, k, v, positions_BL, cache["k"], cache["v"], scale)
    return out, {"k": ck, "v": cv}


def _gqa_cache_keys(k, v, positions_BL, dtype, cache, span):
    new_cache = {"k": write_cache(cache["k"], k, positions_BL), "v": write_cache(cache["v"], v, positions_BL)}
    S = min(span or new_cache["k"].shape[1], new_cache["k"].shape[1])
    k_BSGP, v_BSGP = (new_cache[n][:, :S].astype(dtype) for n in ("k", "v"))
    return new_cache, k_BSGP, v_BSGP


@GQA_ATTENTION.register("cache_decode", _path(cache=True, cp=False, decode=True),
                        doc="a few queries per row against the cache: the decode_attention op")
def _gqa_cache_decode(kernels, q, k, v, positions_BL, segment_ids_BL, scale, dtype, cache, span):
    new_cache, k_BSGP, v_BSGP = _gqa_cache_keys(k, v, positions_BL, dtype, cache, span)
    return decode_attention(kernels, q, k_BSGP, v_BSGP, positions_BL, scale), new_cache


@GQA_ATTENTION.register("cache_prefill", _path(cache=True, cp=False, decode=False),
                        doc="prefill into the cache: the queries against every slot, masked by position")
def _gqa_cache_prefill(kernels, q, k, v, positions_BL, segment_ids_BL, scale, dtype, cache, span):
    new_cache, k_BSGP, v_BSGP = _gqa_cache_keys(k, v, positions_BL, dtype, cache, span)
    B, S = k_BSGP.shape[:2]
    return xla.dot_product_attention(q, k_BSGP, v_BSGP, attention_mask(positions_BL, _slots(B, S)), scale), new_cache


def mla_attention(kernels, q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                  segment_ids_BL, scale: float, dtype, cache=None, span: int | None = None):
    """MLA attention of new tokens from their latents -> (out [B, L, H, O], the updated cache
    {"latent", "k_rope"} or None). Without a cache: per-head K/V expanded from the latents and
    the attention op (under context parallelism the latents are gathered and expanded per
    rank). With a cache: only the latents and rotary keys are stored, and the queries attend
    them in the latent space (the up-projection absorbed), over slots [0, span); under a context
    axis the context-parallel prefill."""
    impl = MLA_ATTENTION.select("auto", current_target(), **_path_spec(q_nope_BLHN.shape[1], cache))
    return impl.fn(kernels, q_nope_BLHN, q_rope_BLHR, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL, segment_ids_BL,
                   scale, dtype, cache, span)


@MLA_ATTENTION.register("packed", _path(cache=False, cp=False),
                        doc="per-head K/V expanded from the latents, the attention op over packed rows")
def _mla_packed(kernels, q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL, segment_ids_BL, scale,
                dtype, cache, span):
    B, L, H, N = q_nope.shape
    R = k_rope_BLR.shape[-1]
    kv = jnp.einsum("blc,chx->blhx", latent_BLC, kv_b_CHX)
    k = jnp.concatenate([kv[..., :N], jnp.broadcast_to(k_rope_BLR[:, :, None], (B, L, H, R))], -1)
    qf = jnp.concatenate([q_nope, q_rope], -1)
    return attention(kernels, qf, k, kv[..., N:], positions_BL, segment_ids_BL, scale), None


@MLA_ATTENTION.register("context_parallel", _path(cache=False, cp=True),
                        doc="the latents gathered over the context axis and expanded per rank (c2jax.ops.attention_cp)")
def _mla_context(kernels, q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL, segment_ids_BL, scale,
                 dtype, cache, span):
    return mla_context_attention(kernels, q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                                 segment_ids_BL, scale, dtype), None


@MLA_ATTENTION.register("context_prefill", _path(cache=True, cp=True),
                        doc="CP prefill: gather the new latents, write the cache, attend the local queries")
def _mla_context_prefill(kernels, q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL, segment_ids_BL,
                         scale, dtype, cache, span):
    out, cl, ckr = cp.mla_context_prefill(q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                                          cache["latent"], cache["k_rope"], scale, dtype)
    return out, {"latent": cl, "k_rope": ckr}


@MLA_ATTENTION.register("latent_cache", _path(cache=True, cp=False),
                        doc="write the latents, attend them in the latent space: the mla_cache_attention op")
def _mla_latent_cache(kernels, q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL, segment_ids_BL,
                      scale, dtype, cache, span):
    new_cache = {"latent": write_cache(cache["latent"], latent_BLC, positions_BL),
                 "k_rope": write_cache(cache["k_rope"], k_rope_BLR, positions_BL)}
    S = span or new_cache["latent"].shape[1]
    out = mla_cache_attention(kernels, q_nope, q_rope, new_cache["latent"][:, :S], new_cache["k_rope"][:, :S],
                              kv_b_CHX, positions_BL, scale, dtype)
    return out, new_cache
