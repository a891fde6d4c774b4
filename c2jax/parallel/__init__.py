"""Parallelism: mesh + logical axis rules (mesh.py), the context-parallel layout (context.py: the
2*CP zigzag, whether CP is on) and multi-host start-up and per-process data (distributed.py).

The programs that run across the mesh are implementations of ops and live in c2jax.ops, one
layer up: attention under CP (c2jax.ops.attention_cp: MLA latent all-gather, GQA ring /
all-gather, CP prefill), expert parallelism (c2jax.ops.experts_ep: all-to-all dispatch over EP
groups, token-parallel shard_map), its ragged exchange (c2jax.ops.ragged) and the sharded
embedding lookup (c2jax.ops.embed). The AOT
compile-and-fit checks for TPU topologies build whole programs, so they live above every layer
(c2jax.tools.compile_check)."""
from c2jax.parallel.mesh import (  # noqa: F401
                                 activate,
                                 data_sharding,
                                 logical_to_mesh_spec,
                                 make_mesh,
                                 tree_shardings,
                                 rules,
                                 validate_layout,
)
