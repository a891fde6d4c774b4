"""DeepSeek-V3 671B: 61 layers (3 dense), MLA, 256 experts top-8 in 8 groups (top-4 groups),
1 shared expert, sigmoid router with aux-loss-free bias, YaRN x40, one MTP layer."""
from c2jax.config import default_config, merge_into_defaults


def get_config(arg=None):
    return merge_into_defaults({
        "model.name": "deepseek_v3_671b", "model.vocab_size": 129280, "model.hidden_size": 7168,
        "model.num_layers": 61, "model.first_k_dense": 3, "model.intermediate_size": 18432,
        "model.moe_intermediate_size": 2048, "model.num_experts": 256, "model.num_experts_per_tok": 8,
        "model.num_shared_experts": 1, "model.router": "sigmoid", "model.router_bias": True,
        "model.norm_topk_prob": True, "model.routed_scaling_factor": 2.5, "model.n_group": 8,
        "model.topk_group": 4, "model.attention": "mla", "model.num_heads": 128, "model.q_lora_rank": 1536,
        "model.kv_lora_rank": 512, "model.qk_nope_head_dim": 128, "model.qk_rope_head_dim": 64,
        "model.v_head_dim": 128, "model.rope_theta": 10000.0, "model.rope_scaling": "yarn",
        "model.yarn_factor": 40.0, "model.yarn_original_max_position": 4096, "model.yarn_mscale": 1.0,
        "model.yarn_mscale_all_dim": 1.0, "model.max_position_embeddings": 163840,
        "model.num_mtp_layers": 1, "model.dtype": "bfloat16", "model.param_dtype": "float32",
    }, default_config())
