"""HF config.json <-> c2jax model config, for `qwen3_moe` and `deepseek_v3` / `kimi_k2`, and
wrappers (Kimi K2.5's `kimi_k25`) whose `text_config` is one of those."""
from __future__ import annotations

import ml_collections

from c2jax.config import model_defaults, validate_model
from c2jax.hf.errors import CheckpointError
from c2jax.models.transformer import model_cfg

SUPPORTED = ("qwen3_moe", "deepseek_v3", "kimi_k2")


def text_config(hf: dict) -> tuple[dict, str | None]:
    """(the text model's config, the wrapper's model_type or None): a multimodal wrapper such as
    Kimi K2.5 holds the DeepSeek-V3-layout text model under text_config; its quantization_config
    (top level) applies to the text model's tensors."""
    if "text_config" not in hf:
        return hf, None
    text = dict(hf["text_config"])
    if "quantization_config" in hf and "quantization_config" not in text:
        text["quantization_config"] = hf["quantization_config"]
    if text.get("model_type") not in SUPPORTED:
        raise CheckpointError(f"{hf.get('model_type')!r} wraps a text model of unsupported model_type "
                              f"{text.get('model_type')!r}; c2jax imports {list(SUPPORTED)}")
    return text, hf.get("model_type")


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
    m = model_defaults()
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
    m.num_mtp_layers = 0   # set by the loader when it imports the MTP layers (c2jax.hf.load, mtp=)
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
                "rope_theta": m.rope_theta, "router_aux_loss_coef": 0.0,
                # qwen3_moe has no MTP: the heads ride along as DeepSeek-V3-style layers
                # num_hidden_layers + d - 1 (transformers ignores them; c2jax.hf.load reads them)
                **({"num_nextn_predict_layers": m.num_mtp_layers} if m.num_mtp_layers else {})}
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
            "rope_parameters": rope, "rope_theta": m.rope_theta, "num_nextn_predict_layers": m.num_mtp_layers}
