"""GPU study model: Qwen3-MoE shape, 1.40B parameters (346M active), between the 89M benchmark
model and the pods, sized so one H200 trains it at 16 x 2048 tokens a step in bf16 with f32
master weights and AdamW. 24 layers, hidden 1024, 64 experts top-8 (width 256), 16 query heads
and 4 KV heads of 128 (cuDNN attention's head size), vocab 32768, untied head.
`experiments/bench/gpu/run_h200.sh` trains it against the transformers peer of the same shape."""
from c2jax.config import default_config, merge_into_defaults

SHAPE = {
    "model.hidden_size": 1024, "model.num_layers": 24, "model.first_k_dense": 0,
    "model.num_experts": 64, "model.num_experts_per_tok": 8, "model.moe_intermediate_size": 256,
    "model.num_shared_experts": 0, "model.intermediate_size": 2816,
    "model.num_heads": 16, "model.num_kv_heads": 4, "model.head_dim": 128,
    "model.vocab_size": 32768, "model.tie_embeddings": False, "model.qk_norm": True,
    "model.router": "softmax", "model.norm_topk_prob": True, "model.max_position_embeddings": 4096,
}


def get_config(arg=None):
    if arg:
        raise ValueError(f"configs/gpu_study.py takes no argument, got {arg!r}")
    return merge_into_defaults({
        "model.name": "gpu_study_1b4", **SHAPE,
        "model.dtype": "bfloat16", "model.param_dtype": "float32", "model.moe_dispatch": "dropless",
        "train.batch_size": 16, "train.seq_len": 2048,
    }, default_config())
