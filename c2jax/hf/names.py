"""Which HF tensor each c2jax param comes from: names, stacked layers, experts, transposes."""
from __future__ import annotations

import dataclasses
from typing import Callable

from c2jax.models.transformer import layer_counts, model_cfg


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


def _block_sources(m, moe: bool, layers: tuple[int, ...] | None, fixed: int | None = None) -> dict[tuple, LeafSource]:
    """A decoder layer's leaves: stacked over `layers`, or (layers None) the single HF layer `fixed`."""
    def layer_of(i):
        return fixed if fixed is not None else i

    def at(suffix, transpose=True):
        return LeafSource(lambda i, e, s=suffix: f"model.layers.{layer_of(i)}.{s}", layers, None, transpose)

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
        out[("moe", ours)] = LeafSource(
            lambda i, e, t=theirs: f"model.layers.{layer_of(i)}.mlp.experts.{e}.{t}.weight", layers, m.num_experts, True)
    if m.num_shared_experts:
        for p in ("gate", "up", "down"):
            out[("moe", "shared", p, "kernel")] = at(f"mlp.shared_experts.{p}_proj.weight")
    return out


def mtp_layer(m, depth: int) -> int:
    """The HF layer index of MTP depth `depth` (1-based): DeepSeek-V3 appends them after the decoder."""
    return m.num_layers + depth - 1


# MTP tensors that duplicate main-model weights in DeepSeek-V3 checkpoints: (HF suffix, our leaf).
MTP_SHARED = (("embed_tokens.weight", ("embed",)), ("shared_head.head.weight", ("lm_head", "kernel")))


def leaf_sources(cfg) -> dict[tuple, LeafSource]:
    """Map every param path of our tree to its HF source (MTP heads to layers num_layers + d - 1)."""
    m = model_cfg(cfg)
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
    for d in range(1, m.num_mtp_layers + 1):
        i, head = mtp_layer(m, d), f"mtp_{d}"
        for suffix, ours in (("hnorm.weight", ("hnorm", "scale")), ("enorm.weight", ("enorm", "scale")),
                             ("shared_head.norm.weight", ("norm", "scale"))):
            out[(head,) + ours] = LeafSource(lambda _i, e, n=f"model.layers.{i}.{suffix}": n)
        out[(head, "eh_proj", "kernel")] = LeafSource(lambda _i, e, n=f"model.layers.{i}.eh_proj.weight": n,
                                                     transpose=True)
        for path, src in _block_sources(m, n_moe > 0, None, fixed=i).items():
            out[(head, "block") + path] = src
    return out
