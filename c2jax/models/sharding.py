"""Shardings of the model's params on a mesh (the model's logical axes through the config's rules)."""
from __future__ import annotations

from c2jax.models.transformer import abstract_params, logical_axes
from c2jax.ops import weights


def param_shardings(cfg, mesh, logical_tree=None, shapes_tree=None):
    """NamedSharding per param leaf; logical_tree / shapes_tree default to the model's."""
    logical_tree = logical_tree if logical_tree is not None else logical_axes(cfg)
    shapes_tree = shapes_tree if shapes_tree is not None else abstract_params(cfg)
    return weights.shardings(cfg, mesh, logical_tree, shapes_tree)
