"""Kimi K2.5 (Composer 2's backbone): 1.04T total / 32B active, 61 layers (first dense), hidden
7168, 384 experts top-8 + 1 shared, sigmoid router with bias, routed scale 2.827, MLA with 64
heads (q 1536, kv 512, 128 nope + 64 rope, v 128), YaRN to 256K (theta 50k), vocab 163840,
one MTP layer (Composer 2 adds MTP for speculative decoding)."""
from c2jax.config import default_config, merge_into_defaults


def get_config(arg=None):
    return merge_into_defaults({
        "model.name": "kimi_k2_1t", "model.vocab_size": 163840, "model.hidden_size": 7168,
        "model.num_layers": 61, "model.first_k_dense": 1, "model.intermediate_size": 18432,
        "model.moe_intermediate_size": 2048, "model.num_experts": 384, "model.num_experts_per_tok": 8,
        "model.num_shared_experts": 1, "model.router": "sigmoid", "model.router_bias": True,
        "model.norm_topk_prob": True, "model.routed_scaling_factor": 2.827, "model.n_group": 1,
        "model.topk_group": 1, "model.attention": "mla", "model.num_heads": 64, "model.q_lora_rank": 1536,
        "model.kv_lora_rank": 512, "model.qk_nope_head_dim": 128, "model.qk_rope_head_dim": 64,
        "model.v_head_dim": 128, "model.rope_theta": 50000.0, "model.rope_scaling": "yarn",
        "model.yarn_factor": 64.0, "model.yarn_original_max_position": 4096, "model.yarn_mscale": 1.0,
        "model.yarn_mscale_all_dim": 1.0, "model.max_position_embeddings": 262144,
        "model.num_mtp_layers": 1, "model.dtype": "bfloat16", "model.param_dtype": "float32",
    }, default_config())
