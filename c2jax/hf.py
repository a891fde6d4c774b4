"""Hugging Face interop for `qwen3_moe` and `deepseek_v3` (Kimi K2 uses the DeepSeek-V3 layout).

`load(dir)` reads config.json and the safetensors files (single or sharded with
model.safetensors.index.json) lazily: each parameter is assembled with
`jax.make_array_from_callback`, so a device (or host) reads only the slices of the tensors it
holds under the target sharding. `save(cfg, params, dir)` writes the legacy per-expert layout
that transformers and other tools load. MTP layers of DeepSeek checkpoints are not imported
(transformers ignores them too).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import jax
import ml_collections
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from c2jax.config import ConfigError, default_config, validate_model
from c2jax.models.layers import dtype_of
from c2jax.models.transformer import abstract_params, layer_counts, model_cfg
from c2jax.treepath import flatten_by_path

SUPPORTED = ("qwen3_moe", "deepseek_v3", "kimi_k2")


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has mis-shaped ones or an unsupported layout."""


# ----------------------------------------------------------------------------- configs


def _rope_params(hf: dict) -> dict:
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rp.setdefault("rope_theta", hf.get("rope_theta", rp.get("rope_theta", 10000.0)))
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
    """Our model config from an HF config.json dict."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise CheckpointError(f"unsupported model_type {mt!r}; c2jax imports {list(SUPPORTED)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    m = default_config().model
    m.name = f"hf:{mt}"
    m.vocab_size = hf["vocab_size"]
    m.hidden_size = hf["hidden_size"]
    m.num_layers = hf["num_hidden_layers"]
    m.intermediate_size = hf["intermediate_size"]
    m.rms_norm_eps = float(hf.get("rms_norm_eps", 1e-6))
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    m.max_position_embeddings = hf.get("max_position_embeddings", 4096)
    m.num_heads = hf["num_attention_heads"]
    m.init_std = float(hf.get("initializer_range", 0.02))
    rp = _rope_params(hf)
    m.rope_theta = float(rp["rope_theta"])
    if rp["rope_type"] == "yarn":
        m.rope_scaling = "yarn"
        m.yarn_factor = float(rp.get("factor") or m.max_position_embeddings / rp["original_max_position_embeddings"])
        m.yarn_original_max_position = int(rp["original_max_position_embeddings"])
        m.yarn_beta_fast = float(rp.get("beta_fast") or 32)
        m.yarn_beta_slow = float(rp.get("beta_slow") or 1)
        m.yarn_mscale = float(rp.get("mscale") or 0.0)
        m.yarn_mscale_all_dim = float(rp.get("mscale_all_dim") or 0.0)
        if rp.get("attention_factor") is not None or rp.get("truncate") is False:
            raise CheckpointError("YaRN with an explicit attention_factor or truncate=False is not supported")
    elif rp["rope_type"] != "default":
        raise CheckpointError(f"unsupported rope_type {rp['rope_type']!r} (default or yarn)")
    if mt == "qwen3_moe":
        if hf.get("use_sliding_window"):
            raise CheckpointError("qwen3_moe with use_sliding_window=True is not supported")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise CheckpointError("qwen3_moe decoder_sparse_step != 1 is not supported (MoE every layer)")
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise CheckpointError(f"mlp_only_layers={dense}: c2jax needs dense layers to come first")
        m.first_k_dense = len(dense)
        m.num_experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
        m.num_experts_per_tok = hf.get("num_experts_per_tok", 1)
        m.moe_intermediate_size = hf.get("moe_intermediate_size", m.moe_intermediate_size)
        m.norm_topk_prob = bool(hf.get("norm_topk_prob", False))
        m.router, m.router_bias, m.num_shared_experts = "softmax", False, 0
        m.routed_scaling_factor, m.n_group, m.topk_group = 1.0, 1, 1
        m.attention = "gqa"
        m.num_kv_heads = hf.get("num_key_value_heads", m.num_heads)
        m.head_dim = hf.get("head_dim") or m.hidden_size // m.num_heads
        m.qk_norm = True
        m.attention_bias = bool(hf.get("attention_bias", False))
    else:
        m.first_k_dense = hf.get("first_k_dense_replace", 0)
        m.num_experts = hf.get("n_routed_experts") or 0
        m.num_experts_per_tok = hf.get("num_experts_per_tok", 1)
        m.moe_intermediate_size = hf.get("moe_intermediate_size", m.moe_intermediate_size)
        m.num_shared_experts = hf.get("n_shared_experts") or 0
        m.norm_topk_prob = bool(hf.get("norm_topk_prob", True))
        m.routed_scaling_factor = float(hf.get("routed_scaling_factor", 1.0))
        m.n_group = hf.get("n_group") or 1
        m.topk_group = hf.get("topk_group") or 1
        m.router = "sigmoid" if hf.get("scoring_func", "sigmoid") == "sigmoid" else "softmax"
        m.router_bias = hf.get("topk_method", "noaux_tc") == "noaux_tc" and m.router == "sigmoid"
        m.attention = "mla"
        m.q_lora_rank = hf.get("q_lora_rank") or 0
        m.kv_lora_rank = hf["kv_lora_rank"]
        m.qk_nope_head_dim = hf["qk_nope_head_dim"]
        m.qk_rope_head_dim = hf["qk_rope_head_dim"]
        m.v_head_dim = hf["v_head_dim"]
        m.rope_interleave = bool(hf.get("rope_interleave", True))
        if hf.get("attention_bias"):
            raise CheckpointError("deepseek_v3 with attention_bias=True is not supported")
    m.num_mtp_layers = 0
    validate_model(m)
    return m


def config_to_hf(cfg) -> dict:
    """An HF config.json dict for our model config (qwen3_moe for GQA, deepseek_v3 for MLA)."""
    m = model_cfg(cfg)
    common = {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "intermediate_size": m.intermediate_size, "moe_intermediate_size": m.moe_intermediate_size,
        "num_attention_heads": m.num_heads, "num_experts_per_tok": m.num_experts_per_tok,
        "norm_topk_prob": m.norm_topk_prob, "rms_norm_eps": m.rms_norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": m.tie_embeddings, "max_position_embeddings": m.max_position_embeddings,
        "initializer_range": m.init_std, "dtype": m.param_dtype, "attention_dropout": 0.0,
    }
    rope = {"rope_theta": m.rope_theta, "rope_type": "default"}
    if m.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=m.yarn_factor, beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow,
                    original_max_position_embeddings=m.yarn_original_max_position)
        if m.yarn_mscale:
            rope["mscale"] = m.yarn_mscale
        if m.yarn_mscale_all_dim:
            rope["mscale_all_dim"] = m.yarn_mscale_all_dim
    if m.attention == "gqa":
        if m.router != "softmax" or m.num_shared_experts or m.routed_scaling_factor != 1.0 or m.n_group > 1:
            raise CheckpointError("a GQA model exports as qwen3_moe, which has a plain softmax router only")
        if not m.qk_norm:
            raise CheckpointError("qwen3_moe export needs model.qk_norm=True")
        return {**common, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
                "num_experts": m.num_experts, "num_local_experts": m.num_experts,
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(m.first_k_dense)), "attention_bias": m.attention_bias,
                "use_sliding_window": False, "sliding_window": None, "rope_parameters": rope,
                "rope_theta": m.rope_theta, "router_aux_loss_coef": 0.0}
    if m.router != "sigmoid":
        raise CheckpointError("an MLA model exports as deepseek_v3, which needs model.router='sigmoid'")
    return {**common, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "num_key_value_heads": m.num_heads, "first_k_dense_replace": m.first_k_dense,
            "n_routed_experts": m.num_experts, "n_shared_experts": m.num_shared_experts,
            "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.n_group,
            "topk_group": m.topk_group, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave, "attention_bias": False,
            "rope_parameters": rope, "rope_theta": m.rope_theta, "num_nextn_predict_layers": 0}


# ----------------------------------------------------------------------------- name mapping


@dataclasses.dataclass(frozen=True)
class LeafSource:
    """Where one of our leaves lives in an HF checkpoint.

    `name(layer, expert)` gives the HF tensor name; `layers` lists the HF layer of each stacked
    index (None for unstacked leaves); `experts` is the expert count for per-expert leaves;
    `transpose` means our leaf holds the transpose of the HF matrix ([in, out] vs [out, in])."""

    name: Callable[[int | None, int | None], str]
    layers: tuple[int, ...] | None = None
    experts: int | None = None
    transpose: bool = False


def _block_sources(m, moe: bool, layers: tuple[int, ...]) -> dict[tuple, LeafSource]:
    def at(suffix, transpose=True):
        return LeafSource(lambda i, e, s=suffix: f"model.layers.{i}.{s}", layers, None, transpose)

    out = {
        ("attn_norm", "scale"): at("input_layernorm.weight", False),
        ("mlp_norm", "scale"): at("post_attention_layernorm.weight", False),
        ("attn", "o_proj", "kernel"): at("self_attn.o_proj.weight"),
    }
    if m.attention == "gqa":
        for p in ("q_proj", "k_proj", "v_proj"):
            out[("attn", p, "kernel")] = at(f"self_attn.{p}.weight")
            if m.attention_bias:
                out[("attn", p, "bias")] = at(f"self_attn.{p}.bias", False)
        if m.qk_norm:
            out[("attn", "q_norm", "scale")] = at("self_attn.q_norm.weight", False)
            out[("attn", "k_norm", "scale")] = at("self_attn.k_norm.weight", False)
    else:
        if m.q_lora_rank:
            out[("attn", "q_a_proj", "kernel")] = at("self_attn.q_a_proj.weight")
            out[("attn", "q_a_norm", "scale")] = at("self_attn.q_a_layernorm.weight", False)
            out[("attn", "q_b_proj", "kernel")] = at("self_attn.q_b_proj.weight")
        else:
            out[("attn", "q_proj", "kernel")] = at("self_attn.q_proj.weight")
        out[("attn", "kv_a_proj", "kernel")] = at("self_attn.kv_a_proj_with_mqa.weight")
        out[("attn", "kv_a_norm", "scale")] = at("self_attn.kv_a_layernorm.weight", False)
        out[("attn", "kv_b_proj")] = at("self_attn.kv_b_proj.weight")
    if not moe:
        for p in ("gate", "up", "down"):
            out[("mlp", p, "kernel")] = at(f"mlp.{p}_proj.weight")
        return out
    out[("moe", "router")] = at("mlp.gate.weight")
    if m.router_bias:
        out[("moe", "router_bias")] = at("mlp.gate.e_score_correction_bias", False)
    for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        out[("moe", ours)] = LeafSource(lambda i, e, t=theirs: f"model.layers.{i}.mlp.experts.{e}.{t}.weight",
                                        layers, m.num_experts, True)
    if m.num_shared_experts:
        for p in ("gate", "up", "down"):
            out[("moe", "shared", p, "kernel")] = at(f"mlp.shared_experts.{p}_proj.weight")
    return out


def leaf_sources(cfg) -> dict[tuple, LeafSource]:
    """Map every param path of our tree to its HF source."""
    m = model_cfg(cfg)
    if m.num_mtp_layers:
        raise CheckpointError("HF interop does not cover MTP heads; set model.num_mtp_layers=0")
    n_dense, n_moe = layer_counts(m)
    out = {("embed",): LeafSource(lambda i, e: "model.embed_tokens.weight"),
           ("final_norm", "scale"): LeafSource(lambda i, e: "model.norm.weight")}
    if not m.tie_embeddings:
        out[("lm_head", "kernel")] = LeafSource(lambda i, e: "lm_head.weight", transpose=True)
    if n_dense:
        for path, src in _block_sources(m, False, tuple(range(n_dense))).items():
            out[("dense_layers", "block") + path] = src
    if n_moe:
        for path, src in _block_sources(m, True, tuple(range(n_dense, n_dense + n_moe))).items():
            out[("moe_layers", "block") + path] = src
    return out


# ----------------------------------------------------------------------------- reading


class _Reader:
    """Lazy tensor access over one or many safetensors files."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            with safe_open(single, framework="numpy") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.path, self.weight_map, self._files = path, weight_map, {}

    def _file(self, name):
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        fname = self.weight_map[name]
        if fname not in self._files:
            full = os.path.join(self.path, fname)
            if not os.path.exists(full):
                raise CheckpointError(f"{self.path}: shard {fname} (holding {name!r}) is missing")
            self._files[fname] = safe_open(full, framework="numpy")
        return self._files[fname]

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name, index=None) -> np.ndarray:
        sl = self._file(name).get_slice(name)
        return sl[index] if index is not None else sl[:]


def _expected_hf_shape(leaf_shape, src: LeafSource):
    shape = tuple(leaf_shape)
    if src.layers is not None:
        shape = shape[1:]
    if src.experts is not None:
        shape = shape[1:]
    return tuple(reversed(shape)) if src.transpose else shape


def _read_leaf_slice(reader: _Reader, src: LeafSource, leaf_shape, index) -> np.ndarray:
    """Read the part `index` (a tuple of slices over our layout) of one leaf."""
    index = tuple(index) + (slice(None),) * (len(leaf_shape) - len(index))
    rest = list(index)
    layer_ids = [None]
    expert_ids = [None]
    if src.layers is not None:
        layer_ids = [src.layers[i] for i in range(*rest.pop(0).indices(len(src.layers)))]
    if src.experts is not None:
        expert_ids = list(range(*rest.pop(0).indices(src.experts)))
    hf_index = tuple(reversed(rest)) if src.transpose else tuple(rest)
    rows = []
    for layer in layer_ids:
        per_expert = []
        for e in expert_ids:
            a = reader.read(src.name(layer, e), hf_index if hf_index else None)
            per_expert.append(a.T if src.transpose else a)
        rows.append(np.stack(per_expert) if src.experts is not None else per_expert[0])
    return np.stack(rows) if src.layers is not None else rows[0]


def _check_shapes(reader: _Reader, sources, shapes):
    for path, src in sources.items():
        leaf = shapes[path]
        want = _expected_hf_shape(leaf.shape, src)
        layers = src.layers if src.layers is not None else (None,)
        experts = range(src.experts) if src.experts is not None else (None,)
        for layer in layers:
            for e in experts:
                name = src.name(layer, e)
                got = reader.shape(name)
                if got != want:
                    raise CheckpointError(f"{reader.path}: tensor {name!r} has shape {list(got)}, "
                                          f"expected {list(want)} for this config")


def load(path: str, shardings=None, dtype: str | None = None):
    """Read an HF checkpoint directory. Returns (model config, params pytree).

    shardings: optional pytree of jax.sharding.Sharding matching the params (e.g. from
    c2jax.parallel.param_shardings); each device reads only its slices. dtype overrides the
    parameter dtype (default float32)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path}: no config.json")
    with open(cfg_path) as f:
        m = config_from_hf(json.load(f))
    if dtype:
        m.param_dtype = dtype
    reader = _Reader(path)
    shapes_tree = abstract_params(m)
    shapes = flatten_by_path(shapes_tree)
    sources = leaf_sources(m)
    missing = set(shapes) - set(sources)
    if missing:
        raise CheckpointError(f"internal: no HF source for params {sorted(missing)}")
    _check_shapes(reader, sources, shapes)
    flat_shardings = flatten_by_path(shardings) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pdt = dtype_of(m.param_dtype)
    leaves = {}
    for path_key, leaf in shapes.items():
        src = sources[path_key]
        sharding = flat_shardings.get(path_key, default)

        def cb(index, src=src, shape=leaf.shape):
            return _read_leaf_slice(reader, src, shape, index).astype(pdt)
        leaves[path_key] = jax.make_array_from_callback(leaf.shape, sharding, cb)
    treedef = jax.tree_util.tree_structure(shapes_tree)
    ordered = [leaves[k] for k in shapes]
    return m, jax.tree_util.tree_unflatten(treedef, ordered)


# ----------------------------------------------------------------------------- writing


def save(cfg, params, path: str, max_shard_bytes: int = 4 << 30, dtype: str | None = None) -> None:
    """Write params as an HF checkpoint (config.json + safetensors, sharded past max_shard_bytes)."""
    m = model_cfg(cfg)
    os.makedirs(path, exist_ok=True)
    hf_cfg = config_to_hf(m)
    if dtype:
        hf_cfg["dtype"] = dtype
    sources = leaf_sources(m)
    flat = flatten_by_path(params)
    if set(flat) != set(sources):
        raise CheckpointError(f"params do not match the config: extra {sorted(set(flat) - set(sources))}, "
                              f"missing {sorted(set(sources) - set(flat))}")
    tensors: dict[str, np.ndarray] = {}
    for path_key, src in sources.items():
        leaf = flat[path_key]
        if not getattr(leaf, "is_fully_addressable", True):
            leaf = jax.experimental.multihost_utils.process_allgather(leaf, tiled=True)
        arr = np.asarray(jax.device_get(leaf))
        if dtype:
            arr = arr.astype(dtype_of(dtype))
        layers = src.layers if src.layers is not None else (None,)
        for li, layer in enumerate(layers):
            a_l = arr[li] if src.layers is not None else arr
            experts = range(src.experts) if src.experts is not None else (None,)
            for e in experts:
                a = a_l[e] if src.experts is not None else a_l
                tensors[src.name(layer, e)] = np.ascontiguousarray(a.T if src.transpose else a)
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
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                       "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)


__all__ = ["load", "save", "config_from_hf", "config_to_hf", "CheckpointError", "ConfigError"]
