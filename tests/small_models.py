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


def random_trajectories(cfg, n: int, seed: int = 0, prompt_len: int = 8, unrecorded: int = 3):
    """n RL rollouts of 10-29 tokens for cfg's model: random tokens, model tokens after prompt_len
    with behaviour logprobs, distinct recorded experts per MoE layer (-1 on the first `unrecorded`
    positions), every third finished by a length limit."""
    import numpy as np

    from c2jax.models.transformer import layer_counts
    from c2jax.trajectory import Trajectory
    rng = np.random.default_rng(seed)
    m = cfg.model
    _, N = layer_counts(m)
    out = []
    for i in range(n):
        T = int(rng.integers(10, 30))
        mask = np.arange(T) >= prompt_len
        ex = np.stack([np.stack([rng.permutation(m.num_experts)[:m.num_experts_per_tok] for _ in range(N)])
                       for _ in range(T)]).astype(np.int32)
        ex[:unrecorded] = -1
        out.append(Trajectory(rng.integers(0, m.vocab_size, T).astype(np.int32), mask,
                              np.where(mask, -3 * rng.random(T), 0).astype(np.float32), np.zeros(T, np.int32), ex,
                              finish_reason="max_tokens" if i % 3 == 0 else "stop"))
    return out
