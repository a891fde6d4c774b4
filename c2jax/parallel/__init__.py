"""Parallelism: mesh + logical axis rules (mesh.py); context and expert parallelism build on it."""
from c2jax.parallel.mesh import (activate, data_sharding, logical_to_mesh_spec, make_mesh,  # noqa: F401
                                 param_shardings, rules)
