"""Parallelism: mesh + logical axis rules (mesh.py), context parallelism (context.py: zigzag
layout, MLA latent all-gather, GQA ring / all-gather), expert parallelism (experts.py: all-to-all
dispatch over EP groups) and multi-host start-up and per-process data (distributed.py). The AOT
compile-and-fit checks for TPU topologies build whole programs, so they live above this layer
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
