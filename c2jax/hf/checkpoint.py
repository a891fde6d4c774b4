"""load / save of HF checkpoint directories (config.json + safetensors), plain, fp8-block or
pack-quantized, with the DeepSeek-V3 MTP layers."""
from __future__ import annotations

import json
import logging
import os
import re

import jax
import numpy as np

from c2jax.config import validate_model
from c2jax.hf import quant
from c2jax.hf.config import config_from_hf, config_to_hf, text_config
from c2jax.hf.errors import CheckpointError
from c2jax.hf.names import MTP_SHARED, LeafSource, leaf_sources, mtp_layer
from c2jax.hf.reader import Checkpoint
from c2jax.hf.safetensors_io import COUNTER, write_file
from c2jax.models.layers import dtype_of
from c2jax.models.transformer import abstract_params, model_cfg
from c2jax.treepath import flatten_by_path

log = logging.getLogger(__name__)

# The Linear weights DeepSeek-V3 / Kimi K2 store as fp8 blocks (router, embeddings, head, norms
# and the MTP eh_proj stay bf16).
FP8_WEIGHTS = re.compile(r"\.(q_a_proj|q_b_proj|q_proj|k_proj|v_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|"
                         r"gate_proj|up_proj|down_proj)\.weight$")
# The routed experts K2-Thinking / K2.5 store pack-quantized.
INT_WEIGHTS = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
QUANTS = ("none", "fp8", "int4")


def _expected_hf_shape(leaf_shape, src: LeafSource):
    shape = tuple(leaf_shape)
    if src.layers is not None:
        shape = shape[1:]
    if src.experts is not None:
        shape = shape[1:]
    return tuple(reversed(shape)) if src.transpose else shape


def _read_leaf_slice(ckpt: Checkpoint, src: LeafSource, leaf_shape, index, dtype) -> np.ndarray:
    """Read the part `index` (a tuple of slices over our layout) of one leaf, as `dtype`, filling
    one output buffer matrix by matrix (host memory: the slice plus one HF matrix)."""
    index = tuple(index) + (slice(None),) * (len(leaf_shape) - len(index))
    rest = list(index)
    layer_ids, expert_ids = [None], [None]
    if src.layers is not None:
        layer_ids = [src.layers[i] for i in range(*rest.pop(0).indices(len(src.layers)))]
    if src.experts is not None:
        expert_ids = list(range(*rest.pop(0).indices(src.experts)))
    hf_index = tuple(reversed(rest)) if src.transpose else tuple(rest)
    out = np.empty(tuple(len(range(*s.indices(d))) for s, d in zip(index, leaf_shape)), dtype)
    for li, layer in enumerate(layer_ids):
        for ei, e in enumerate(expert_ids):
            a = ckpt.read(src.name(layer, e), hf_index if hf_index else None)
            at = (li,) if src.layers is not None else ()
            at += (ei,) if src.experts is not None else ()
            out[at] = a.T if src.transpose else a
    return out


def _check_shapes(ckpt: Checkpoint, sources, shapes):
    for path, src in sources.items():
        want = _expected_hf_shape(shapes[path].shape, src)
        for layer in (src.layers if src.layers is not None else (None,)):
            for e in (range(src.experts) if src.experts is not None else (None,)):
                name = src.name(layer, e)
                got = ckpt.shape(name)
                if got != want:
                    raise CheckpointError(f"{ckpt.path}: tensor {name!r} has shape {list(got)}, "
                                          f"expected {list(want)} for this config")


def _mtp_layers(hf_text: dict, m, ckpt: Checkpoint, mtp: bool | None, stats: dict) -> int:
    """How many MTP layers to import: all the checkpoint has, unless mtp=False or (mtp=None) some
    are missing. Each head keeps its own output norm (shared_head.norm); its embedding and head
    copies are the main model's and are not read."""
    n = int(hf_text.get("num_nextn_predict_layers") or 0)
    present = [d for d in range(1, n + 1) if ckpt.has(f"model.layers.{mtp_layer(m, d)}.eh_proj.weight")]
    if mtp is True and (not n or len(present) != n):
        raise CheckpointError(f"{ckpt.path}: mtp=True but the checkpoint has {len(present)} of "
                              f"num_nextn_predict_layers={n} MTP layers (model.layers.{m.num_layers}.eh_proj.weight ...)")
    if mtp is False or not present or len(present) != n:
        if n and mtp is not False and len(present) != n:
            stats["mtp_skipped"] = f"{len(present)} of num_nextn_predict_layers={n} MTP layers present"
        return 0
    return n


def load(path: str, shardings=None, dtype: str | None = None, mtp: bool | None = None,
         stats: dict | None = None, progress=None):
    """Read an HF checkpoint directory. Returns (model config, params pytree).

    shardings: optional pytree of jax.sharding.Sharding matching the params (e.g. from
    c2jax.parallel.param_shardings); each device reads only the bytes of its slices. dtype
    overrides the parameter dtype (default float32). Quantized weights (fp8 blocks,
    pack-quantized int4/int8) are dequantized to it once, here. mtp: import the DeepSeek-V3
    MTP layers (None: when present and representable, or, given shardings, iff they hold MTP heads). stats: a dict filled with
    `skipped` (tensors outside the text model by top-level name), `unused`, `reads`
    ([(param path, index, bytes read)] per slice callback), `bytes_read`, `quant`.
    progress(done, total): called after each param."""
    stats = {} if stats is None else stats
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path}: no config.json")
    with open(cfg_path) as f:
        hf, wrapper = text_config(json.load(f))
    scheme = quant.scheme_of(hf)
    m = config_from_hf(hf)
    if dtype:
        m.param_dtype = dtype
    ckpt = Checkpoint(path, scheme, wrapped=wrapper is not None)
    flat_shardings = flatten_by_path(shardings) if shardings is not None else {}
    if shardings is not None and mtp is None:   # the target tree decides: MTP heads iff it has them
        mtp = any(str(k[0]).startswith("mtp_") for k in flat_shardings)
    m.num_mtp_layers = _mtp_layers(hf, m, ckpt, mtp, stats)
    validate_model(m)
    shapes_tree = abstract_params(m)
    shapes = flatten_by_path(shapes_tree)
    sources = leaf_sources(m)
    missing = set(shapes) - set(sources)
    if missing:
        raise CheckpointError(f"internal: no HF source for params {sorted(missing)}")
    _check_shapes(ckpt, sources, shapes)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pdt = dtype_of(m.param_dtype)
    stats.update(skipped=dict(ckpt.skipped), reads=[], quant=scheme.method, wrapper=wrapper)
    start = COUNTER.total
    leaves = {}
    for done, (path_key, leaf) in enumerate(shapes.items(), 1):
        src = sources[path_key]

        def cb(index, src=src, shape=leaf.shape, key=path_key):
            with COUNTER.scope() as box:
                a = _read_leaf_slice(ckpt, src, shape, index, pdt)
            stats["reads"].append((key, tuple(index), box[0]))
            return a
        leaves[path_key] = jax.make_array_from_callback(leaf.shape, flat_shardings.get(path_key, default), cb)
        if progress:
            progress(done, len(shapes))
    stats["bytes_read"] = COUNTER.total - start
    used = {src.name(layer, e) for src in sources.values()
            for layer in (src.layers if src.layers is not None else (None,))
            for e in (range(src.experts) if src.experts is not None else (None,))}
    for d in range(1, m.num_mtp_layers + 1):
        used |= {f"model.layers.{mtp_layer(m, d)}.{s}" for s, _ in MTP_SHARED}
    stats["unused"] = ckpt.unused(used)
    treedef = jax.tree_util.tree_structure(shapes_tree)
    return m, jax.tree_util.tree_unflatten(treedef, [leaves[k] for k in shapes])


# ----------------------------------------------------------------------------- writing


def _quantization_config(m, quantize: str, block) -> dict:
    if quantize == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": 32, "dynamic": False, "actorder": None, "observer": "minmax"}}},
            "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj$",
                       r"re:.*eh_proj$"],
            "kv_cache_scheme": None}


def _int_quantize_exact(w: np.ndarray, bits: int, group: int, scale_dtype):
    """Group quantization that recovers the scale of weights dequantized from this format (a group's
    scale is amax / 2**(bits-1) or amax / (2**(bits-1) - 1) there, and q * scale reproduces every
    value): quantize -> load -> quantize is bit-exact. Fresh weights get the min-max rule."""
    packed, scale = quant.int_quantize(w, bits, group, scale_dtype)
    R, C = w.shape
    wg = np.asarray(w, np.float32).reshape(R, C // group, group)
    amax = np.abs(wg).max(-1)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = quant.unpack_int(packed, bits, C).reshape(R, C // group, group)
    for div in (-lo, hi):
        s = (amax / div).astype(scale_dtype)
        s32 = s.astype(np.float32)[..., None]
        qc = np.round(wg / np.where(s32 == 0, 1, s32))
        ok = (qc >= lo).all(-1) & (qc <= hi).all(-1) & ((qc * s32).astype(np.float32) == wg).all(-1) & (amax > 0)
        scale = np.where(ok, s, scale)
        q = np.where(ok[..., None], qc, q)
    return quant.pack_int(q.reshape(R, C).astype(np.int8), bits), scale


def _hf_tensors(m, params, dtype, quantize: str, block):
    """Yield (name, array) for every tensor the checkpoint holds (quantized parts included)."""
    sources = leaf_sources(m)
    flat = flatten_by_path(params)
    if set(flat) != set(sources):
        raise CheckpointError(f"params do not match the config: extra {sorted(set(flat) - set(sources))}, "
                              f"missing {sorted(set(sources) - set(flat))}")
    out_dt = dtype_of(dtype) if dtype else None
    for path_key, src in sources.items():
        leaf = flat[path_key]
        if not getattr(leaf, "is_fully_addressable", True):
            leaf = jax.experimental.multihost_utils.process_allgather(leaf, tiled=True)
        arr = np.asarray(jax.device_get(leaf))
        for li, layer in enumerate(src.layers if src.layers is not None else (None,)):
            a_l = arr[li] if src.layers is not None else arr
            for e in (range(src.experts) if src.experts is not None else (None,)):
                a = a_l[e] if src.experts is not None else a_l
                a = np.ascontiguousarray(a.T if src.transpose else a)
                name = src.name(layer, e)
                if quantize == "fp8" and FP8_WEIGHTS.search(name):
                    q, s = quant.fp8_quantize(a, block)
                    yield name, q
                    yield name + "_scale_inv", s
                elif quantize == "int4" and INT_WEIGHTS.search(name):
                    packed, s = _int_quantize_exact(a, 4, 32, dtype_of("bfloat16"))
                    base = name.removesuffix("weight")
                    yield base + "weight_packed", packed
                    yield base + "weight_scale", s
                    yield base + "weight_shape", np.asarray(a.shape, np.int32)
                else:
                    yield name, a.astype(out_dt) if out_dt is not None else a
    head = flat.get(("lm_head", "kernel"))
    for d in range(1, m.num_mtp_layers + 1):
        # DeepSeek-V3 layout: each MTP layer carries copies of the embedding, final norm and head.
        i = mtp_layer(m, d)
        for suffix, ours in MTP_SHARED:
            a = flat[("embed",)] if ours == ("lm_head", "kernel") and head is None else flat[ours]
            a = np.asarray(jax.device_get(a))
            a = a.T if ours == ("lm_head", "kernel") else a
            yield f"model.layers.{i}.{suffix}", np.ascontiguousarray(a.astype(out_dt) if out_dt is not None else a)


def save(cfg, params, path: str, max_shard_bytes: int = 4 << 30, dtype: str | None = None,
         quantize: str = "none", block=(128, 128), progress=None) -> None:
    """Write params as an HF checkpoint (config.json + safetensors, sharded past max_shard_bytes).

    quantize: "none"; "fp8" (DeepSeek-V3 / Kimi K2 format: Linear weights as float8_e4m3fn with
    float32 scale_inv per `block`); "int4" (the routed experts pack-quantized as compressed-tensors,
    Kimi K2-Thinking format). dtype: the dtype of the tensors left unquantized (default: the
    params'). A checkpoint loaded in float32 and saved in its own format is written back bit
    for bit. MTP heads are written as DeepSeek-V3 layers num_hidden_layers + d - 1.
    progress(done, None): called after each tensor is prepared."""
    if quantize not in QUANTS:
        raise CheckpointError(f"unknown quantize {quantize!r}; one of {list(QUANTS)}")
    m = model_cfg(cfg)
    hf_cfg = config_to_hf(m)
    if quantize != "none":
        if m.attention != "mla":
            raise CheckpointError(f"quantize={quantize!r} writes the DeepSeek-V3 / Kimi layout; this model is GQA")
        hf_cfg["quantization_config"] = _quantization_config(m, quantize, block)
    if dtype:
        hf_cfg["dtype"] = dtype
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, a in _hf_tensors(m, params, dtype, quantize, block):
        tensors[name] = a
        if progress:
            progress(len(tensors), None)
    if jax.process_index() != 0:
        return
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        write_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                       "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
