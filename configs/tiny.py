"""Tiny CPU model (the demo's). `configs/tiny.py` is Qwen3-MoE-shaped (GQA, softmax router);
`configs/tiny.py:mla` is DeepSeek-V3/Kimi-shaped (MLA, sigmoid router with selection bias,
shared expert, one dense layer first)."""
from c2jax.config import default_config, merge_into_defaults


def get_config(arg=None):
    cfg = default_config()
    updates = {
        "model.name": "tiny", "model.vocab_size": 1024, "model.hidden_size": 128, "model.num_layers": 4,
        "model.first_k_dense": 1, "model.intermediate_size": 256, "model.moe_intermediate_size": 128,
        "model.num_experts": 8, "model.num_experts_per_tok": 2, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.head_dim": 32, "model.max_position_embeddings": 2048,
        "model.init_std": 0.02,
        # one MTP head, as the report's model has: self-distilled in CPT, SFT and RL, drafting
        # tokens for speculative decoding in rollouts and evaluation
        "model.num_mtp_layers": 1,
        # A few CPU minutes of CPT on the stdlib corpus.
        "data.vocab_size": 1024, "data.tokenizer_sample_mb": 4.0, "data.codebase_max_tokens": 8192,
        "train.steps": 150, "train.batch_size": 8, "train.seq_len": 256, "train.lr": 3e-3,
        "train.warmup_steps": 10, "train.eval_every": 50, "train.checkpoint_every": 25,
        "train.eval_batches": 4, "train.log_every": 10,
    }
    if arg == "mla":
        updates.update({
            "model.name": "tiny_mla", "model.attention": "mla", "model.router": "sigmoid",
            "model.router_bias": True, "model.num_shared_experts": 1, "model.routed_scaling_factor": 2.5,
            "model.q_lora_rank": 64, "model.kv_lora_rank": 32, "model.qk_nope_head_dim": 32,
            "model.qk_rope_head_dim": 16, "model.v_head_dim": 32, "model.n_group": 2, "model.topk_group": 1,
        })
    elif arg not in (None, "", "gqa"):
        raise ValueError(f"configs/tiny.py: unknown arg {arg!r}; use gqa or mla")
    return merge_into_defaults(updates, cfg)
