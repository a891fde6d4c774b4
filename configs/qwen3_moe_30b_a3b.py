"""Qwen3-Coder-30B-A3B shape (the report's small-study model): 48 layers, GQA with QK-norm,
128 experts top-8, softmax router, no shared expert."""
from c2jax.config import default_config, merge_into_defaults


def get_config(arg=None):
    return merge_into_defaults({
        "model.name": "qwen3_moe_30b_a3b", "model.vocab_size": 151936, "model.hidden_size": 2048,
        "model.num_layers": 48, "model.first_k_dense": 0, "model.intermediate_size": 6144,
        "model.moe_intermediate_size": 768, "model.num_experts": 128, "model.num_experts_per_tok": 8,
        "model.norm_topk_prob": True, "model.router": "softmax", "model.attention": "gqa",
        "model.num_heads": 32, "model.num_kv_heads": 4, "model.head_dim": 128, "model.qk_norm": True,
        "model.rope_theta": 10_000_000.0, "model.max_position_embeddings": 262144,
        "model.dtype": "bfloat16", "model.param_dtype": "float32",
    }, default_config())
