"""c2jax.ops: one layer decides how each op the model uses is computed.

Per op (attention, decode_attention, mla_cache_attention, experts, matmul, norm, token_nll,
head_grad, optimizer, embed, and the attention layers' paths gqa_attention / mla_attention) a registry of
named implementations with `supported(target, **spec) -> reason | None`; the config picks
(`model.kernels.<op>`, `train.optimizer`): "auto" = the op's table for the target platform, a
name = that implementation or an error with its reason. The target comes from the active mesh's
devices (c2jax.ops.target). `python -m c2jax.ops` lists the implementations.

How an op runs across a mesh is part of its implementation: attention_cp (attention under
context parallelism), experts_ep (expert-parallel and token-parallel MoE dispatch), ragged (the
EP exchange's ragged all-to-all) and embed (the sharded lookup) sit here, above c2jax.parallel's
mesh, rules and layouts; so do the weights' layouts (weights: prepared decode layouts and
param shardings; stacked: a layer of the scanned stacks read in place) and the token order on
the mesh (sequence: the CP zigzag), so that the model never looks at the mesh itself.
This package's __init__ imports only the registry and the target, no op module; import the op
modules themselves: `from c2jax.ops import experts` (load_all imports every one).
"""
from c2jax.ops.registry import OPS, KernelUnavailable, kernels_choice, record_choices  # noqa: F401
from c2jax.ops.target import Target, current_target, target_of_mesh  # noqa: F401

OP_MODULES = ("c2jax.ops.attention", "c2jax.ops.experts", "c2jax.ops.layers", "c2jax.ops.token_nll",
              "c2jax.ops.optimizer", "c2jax.ops.embed")


def load_all() -> dict:
    """Import every op module (filling OPS) and return OPS."""
    import importlib
    for name in OP_MODULES:
        importlib.import_module(name)
    return OPS
