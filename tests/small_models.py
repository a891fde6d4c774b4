"""The shrunk tiny models the model, cache and sampler tests share (imported as `small_models`:
tests/ is on sys.path through tests/conftest.py)."""
from c2jax.config import apply_overrides, load_config, validate


def small_model_cfg(attention: str, **model_overrides):
    """configs/tiny.py (GQA) or configs/tiny.py:mla shrunk: vocab 97, width 32, 2 layers (MLA: 1
    dense + 1 MoE), 8 experts top-2, dropless grouped dispatch; `model_overrides` on top."""
    cfg = load_config("configs/tiny.py:mla" if attention == "mla" else "configs/tiny.py")
    upd = {"model.vocab_size": 97, "model.hidden_size": 32, "model.num_layers": 2,
           "model.first_k_dense": 1 if attention == "mla" else 0, "model.intermediate_size": 48,
           "model.moe_intermediate_size": 16, "model.num_heads": 4, "model.init_std": 0.15,
           "model.moe_dispatch": "dropless"}
    if attention == "mla":
        upd.update({"model.q_lora_rank": 16, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
                    "model.qk_rope_head_dim": 4, "model.v_head_dim": 8})
    else:
        upd.update({"model.num_kv_heads": 2, "model.head_dim": 8})
    upd.update({f"model.{k}": v for k, v in model_overrides.items()})
    apply_overrides(cfg, upd)
    validate(cfg)
    return cfg
