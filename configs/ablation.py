"""Small Qwen3-MoE ablation sizes for the report's small-scale studies.
Arg: s (~10M params), m (~30M), l (~89M, the shape of experiments/bench/train_step.py)."""
from c2jax.config import default_config, merge_into_defaults

SIZES = {
    "s": {"model.hidden_size": 256, "model.num_layers": 4, "model.num_experts": 8, "model.num_experts_per_tok": 2,
          "model.moe_intermediate_size": 256, "model.intermediate_size": 768, "model.num_heads": 4,
          "model.num_kv_heads": 2, "model.head_dim": 64, "model.vocab_size": 8192},
    "m": {"model.hidden_size": 384, "model.num_layers": 6, "model.num_experts": 16, "model.num_experts_per_tok": 2,
          "model.moe_intermediate_size": 256, "model.intermediate_size": 1024, "model.num_heads": 6,
          "model.num_kv_heads": 2, "model.head_dim": 64, "model.vocab_size": 8192},
    "l": {"model.hidden_size": 512, "model.num_layers": 6, "model.num_experts": 16, "model.num_experts_per_tok": 2,
          "model.moe_intermediate_size": 512, "model.intermediate_size": 1536, "model.num_heads": 8,
          "model.num_kv_heads": 4, "model.head_dim": 64, "model.vocab_size": 8192},
}


def get_config(arg=None):
    size = arg or "s"
    if size not in SIZES:
        raise ValueError(f"configs/ablation.py: unknown size {size!r}; choose one of {sorted(SIZES)}")
    return merge_into_defaults({"model.name": f"ablation_{size}", "model.max_position_embeddings": 4096,
                                "model.num_mtp_layers": 1,   # one MTP head, as the report's model
                                **SIZES[size]}, default_config())
