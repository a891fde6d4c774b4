"""Models: Qwen3-MoE (GQA) and DeepSeek-V3/Kimi-K2 (MLA) decoders as functional Flax modules."""
from c2jax.models.transformer import (ForwardOutput, Transformer, abstract_params, flops_per_token,  # noqa: F401
                                      forward, forward_with_cache, head_weight,
                                      init_cache, init_params, layer_counts,
                                      logical_axes, param_count)
from c2jax.models.moe import update_router_bias  # noqa: F401
from c2jax.ops.weights import Weights  # noqa: F401
from c2jax.models.sharding import param_shardings  # noqa: F401
