"""The CPU decode step: the model's forward on the KV-cache path with the layer loop unrolled and
every layer's weights, and every expert's, held as separate arrays ("split params").

Why: XLA CPU copies any slice of an array before a matmul reads it. The model's scanned layer
stack slices each layer out of stacked [Y, ...] params, so every decode step copied all the
weights (all experts of every layer, ~3x the bytes a step must read), and the capacity /
gather dispatches copied the chosen experts again. Here nothing is sliced: each matmul reads
its weight in place, and the MoE runs only the experts some row chose (c2jax.ops.experts.decode_layout_experts).
The KV cache is kept per layer (split_cache; the Sampler holds it so between chunks), so each
step updates it in place instead of re-stacking it; stack_layers is the inverse.

Same math as c2jax.models.forward_with_cache: each layer is the model's own Block applied to that
layer's params, its MoE dispatching over the stored per-expert buffers (c2jax.ops.experts.decode_layout_experts);
prefill keeps the model's own forward. Not for quantized weights (the sampler falls back to the model's step).

On CPU in float32 the MoE of each layer and the output head are FFI calls (c2jax.backends.cpu.kernels)
streaming each weight once for up to 8 rows (XLA CPU's few-row products stream at a third of
the one-row rate, so the XLA dispatch runs rows one by one); C2JAX_CPU_KERNELS=0 keeps XLA's.

Letters: B rows, L tokens per row, D width, V vocab, K experts per token, Y layers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from c2jax.models import transformer as tfm
from c2jax.models.layers import Linear, RMSNorm, dtype_of
from c2jax.backends.cpu import kernels as cpu_kernels
from c2jax.ops import experts as experts_ops
from c2jax.ops.experts_xla import shard_experts, split_experts
from c2jax.ops.target import current_target, target_of_mesh
from c2jax.ops.weights import Weights, separate, variables

STACKS = (("dense_layers", "dense", False), ("moe_layers", "moe", True))
CAST = ("kernel", "w_gate", "w_up", "w_down", "kv_b_proj", "embed")  # the model casts these to dtype


def supported(m) -> str | None:
    """Why the split decode step cannot run model config m, or None when it can."""
    if m.quant != "none":
        return f"quantized weights (model.quant={m.quant!r})"
    return None


def decode_layout(m, mesh=None) -> str:
    """How split_params lays out model config m's weights for the decode mesh (or this process's
    device): c2jax.ops.experts.decode_layout's "packed" or "split"."""
    target = current_target() if mesh is None else target_of_mesh(mesh)
    return experts_ops.decode_layout(target, m, 1 if mesh is None else mesh.size)


@functools.lru_cache(maxsize=8)
def _splitter(model_json: str, mesh=None, layout: str = "split"):
    import json

    import ml_collections
    m = ml_collections.ConfigDict(json.loads(model_json))
    dt = dtype_of(m.dtype)

    def cast(tree):
        return {k: cast(v) if isinstance(v, dict) else (v.astype(dt) if k in CAST else v)
                for k, v in tree.items()}

    @jax.jit
    def split(params):
        layers = []
        for stack, _, moe in STACKS:
            if stack not in params:
                continue
            block = cast(params[stack]["block"])
            for i in range(jax.tree.leaves(block)[0].shape[0]):
                p = jax.tree.map(lambda a: a[i], block)
                if moe:
                    mp = dict(p["moe"])
                    ws = [mp.pop(k) for k in ("w_gate", "w_up", "w_down")]
                    if layout == "packed":
                        mp["experts"] = cpu_kernels.pack_experts(*ws, mesh)
                    else:
                        mp["experts"] = split_experts(*ws) if mesh is None else shard_experts(*ws, mesh)
                    p = {**p, "moe": mp}
                if layout == "packed":
                    p = _pack_linears(m, p, mesh)
                layers.append(p)
        out = {"embed": params["embed"].astype(dt), "final_norm": params["final_norm"], "layers": layers}
        if "lm_head" in params:
            out["lm_head"] = cast(params["lm_head"])
        head_DV = out["lm_head"]["kernel"] if "lm_head" in out else out["embed"].T
        if layout == "packed" and not cpu_kernels.matrix_packable(head_DV, 1 if mesh is None else mesh.size):
            out["lm_head"] = {"kernel": cpu_kernels.pack_matrix(head_DV, mesh)}   # also a tied head
        return separate(out)
    return split


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "gate", "up", "down")


def _pack_linears(m, tree, mesh):
    """The layer's Linear kernels as cpu_kernels.PackedMatrix where the kernel can run them: all
    of them on one device; over a mesh, the head-parallel GQA projections (q/k/v by columns,
    o by rows, as split_params shards them), the rest left to XLA (replicated)."""
    n = 1 if mesh is None else mesh.size
    split = {} if n == 1 else ({"q_proj": "columns", "k_proj": "columns", "v_proj": "columns", "o_proj": "rows"}
                               if _head_parallel(m, n) else {})

    def walk(t):
        out = {}
        for k, v in t.items():
            how = "columns" if n == 1 else split.get(k)
            if (isinstance(v, dict) and k in LINEARS and getattr(v.get("kernel"), "ndim", 0) == 2 and how
                    and not cpu_kernels.matrix_packable(v["kernel"], n, how)):
                out[k] = {**v, "kernel": cpu_kernels.pack_matrix(v["kernel"], mesh, how)}
            else:
                out[k] = walk(v) if isinstance(v, dict) else v
        return out
    return walk(tree)


def split_params(m, params, mesh=None) -> Weights:
    """Split weights for decode_step (one jitted copy, in the compute dtype): Weights over
    {embed, final_norm, lm_head?, layers: [per layer, dense layers first]}, whose prepared
    collection holds the MoE layers' experts as decode_layout picks: cpu_kernels.PackedExperts (one FFI call a layer that reads each
    chosen expert once) or moe.split_experts' per-expert buffers; with the kernels, lm_head's kernel
    (the tied embedding too) is a cpu_kernels.PackedMatrix and so are the Linear kernels
    PackedMatrix where the kernel can run them (_pack_linears). Every array is its own buffer.

    With a 1-D mesh of n host devices (decode_mesh), the step's weight reads are split over the
    devices (on CPU XLA runs one device's matmuls one at a time, so one device streams weights
    from one core): each device holds 1/n of every expert's hidden columns (PackedExperts, or
    ops.experts_xla.ShardedExperts, which falls back to whole experts when n does not divide that size), GQA attention is
    split by heads (q/k/v_proj by output columns, o_proj by input rows; the cache by KV head,
    cache_shardings) and the output head by vocab; everything else is replicated. XLA inserts
    the reductions."""
    reason = supported(m)
    if reason:
        raise ValueError(f"split decode params do not support {reason}")
    layout = decode_layout(m, mesh)
    if mesh is None or mesh.size == 1:
        return _splitter(m.to_json(), None, layout)(params)
    n = mesh.size
    if not m.num_experts or (m.moe_intermediate_size % n and m.num_experts % n):
        raise ValueError(f"decode over {n} devices needs a MoE model whose moe_intermediate_size "
                         f"({m.moe_intermediate_size}) or num_experts ({m.num_experts}) {n} divides")
    heads = _head_parallel(m, n)
    ax = mesh.axis_names[0]

    def spec(path, a):
        names = [getattr(k, "key", None) for k in path]
        if "experts" in names:    # ShardedExperts slots / PackedExperts: [n, ...], row d on device d
            return P(ax)
        if "kernel" in names and isinstance(names[-1], int):  # a PackedMatrix's w: [n, ...], row d on device d
            return P(ax)
        if heads and "attn" in names and names[-1] in ("kernel", "bias"):
            if {"q_proj", "k_proj", "v_proj"} & set(names):
                return P(ax) if a.ndim == 1 else P(None, ax)
            if "o_proj" in names and a.ndim == 2:
                return P(ax, None)
        if "lm_head" in names and a.ndim == 2 and a.shape[1] % n == 0:
            return P(None, ax)
        return P()

    sp = _splitter(m.to_json(), mesh, layout)(params)
    return jax.tree_util.tree_map_with_path(lambda p, a: jax.device_put(a, NamedSharding(mesh, spec(p, a))), sp)


def _head_parallel(m, n: int) -> bool:
    """May GQA attention be split by heads over n devices?"""
    return m.attention != "mla" and m.num_heads % n == 0 and m.num_kv_heads % n == 0


def cache_shardings(m, cache, mesh):
    """Shardings for the model's caches under split_params(..., mesh), stacked (a dict of
    [Y, B, S, ...]) or per layer (split_cache's list of [B, S, ...]): GQA K/V split by KV head
    when attention is head-parallel, else replicated."""
    ax = mesh.axis_names[0]
    split = _head_parallel(m, mesh.size)
    kv_rank = 4 if isinstance(cache, list) else 5   # [B, S, G, P] or [Y, B, S, G, P]

    def one(a):
        return NamedSharding(mesh, P(*[None] * (kv_rank - 2), ax, None) if split and a.ndim == kv_rank else P())
    return jax.tree.map(one, cache)


def decode_mesh(n: int):
    """A 1-D mesh of the first n devices for expert-parallel decode (CPU: start the process with
    XLA_FLAGS=--xla_force_host_platform_device_count=n); None for n == 1."""
    if n == 1:
        return None
    devices = jax.devices()
    if n < 1 or n > len(devices):
        raise ValueError(f"decode_devices={n} but this process has {len(devices)} {current_target().platform} "
                         f"device(s); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                         "before JAX starts")
    return Mesh(np.array(devices[:n]), ("decode",))


def split_cache(cache) -> list:
    """The model's stacked caches {"dense": ..., "moe": ...} -> per-layer caches, dense first."""
    out = []
    for _, key, _ in STACKS:
        if key in cache:
            n = jax.tree.leaves(cache[key])[0].shape[0]
            out += [jax.tree.map(lambda a: a[i], cache[key]) for i in range(n)]
    return out


def stack_layers(n_dense: int, layers: list) -> dict:
    """Inverse of split_cache: per-layer caches (the first n_dense dense) -> the stacked dict."""
    out = {}
    for key, part in (("dense", layers[:n_dense]), ("moe", layers[n_dense:])):
        if part:
            out[key] = jax.tree.map(lambda *a: jnp.stack(a), *part)
    return out


def decode_step(m, sp: Weights, tokens_BL, positions_BL, caches: list, span: int | None = None) -> tfm.ForwardOutput:
    """forward_with_cache on split_params' weights sp and per-layer caches: ForwardOutput(logits f32
    [B, L, V], {"expert_ids": int32 [N, B, L, K]} (MoE models), new per-layer caches). span
    (static): attention reads cache slots [0, span) only; every position must be < span."""
    dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
    n_dense, n_moe = tfm.layer_counts(m)
    layers = sp.params["layers"]
    if len(layers) != len(caches) or len(caches) != m.num_layers:
        raise ValueError(f"need {m.num_layers} layers of params and caches, got {len(layers)}, {len(caches)}")
    tokens_BL = jnp.asarray(tokens_BL, jnp.int32)
    positions_BL = jnp.asarray(positions_BL, jnp.int32)
    seg_BL = jnp.ones_like(tokens_BL)
    x_BLD = jnp.take(sp.params["embed"], tokens_BL, axis=0).astype(dt)
    expert_ids, new_caches = [], []
    for i, (p, cache) in enumerate(zip(layers, caches)):
        # the model's own layer; its MoE reads the stored per-expert buffers (prepared ["moe"]["experts"])
        x_BLD, aux, cache = tfm.Block(m, i >= n_dense, span).apply(
            variables(Weights(p, sp.prepared["layers"][i])), x_BLD, positions_BL, seg_BL, None, cache)
        if i >= n_dense:
            expert_ids.append(aux["expert_ids"])
        new_caches.append(cache)
    norm = RMSNorm(m.rms_norm_eps, "embed", pdt)
    h_BLD = norm.apply({"params": sp.params["final_norm"]}, x_BLD)
    if "lm_head" not in sp.params:  # tied, unpacked
        logits = jnp.einsum("bld,vd->blv", h_BLD, sp.params["embed"], preferred_element_type=jnp.float32)
    else:  # Linear also runs a PackedMatrix kernel (split_params packs the head, tied or not, for the CPU kernels)
        head = Linear(m.vocab_size, ("embed", "vocab"), dtype=dt, param_dtype=pdt, init_std=m.init_std)
        logits = head.apply(variables(Weights(sp.params["lm_head"], sp.prepared["lm_head"])), h_BLD)
    aux = {"expert_ids": jnp.stack(expert_ids)} if n_moe else {}
    return tfm.ForwardOutput(logits.astype(jnp.float32), aux, new_caches)
