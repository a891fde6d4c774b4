"""Key paths of pytrees as plain name tuples (shared by optimizer masks, shardings, HF mapping)."""
from __future__ import annotations

import jax


def key_names(path) -> tuple[str, ...]:
    """('moe_layers', 'block', 'moe', 'w_gate') for a jax key path (dict keys, attrs, indices)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def flatten_by_path(tree, is_leaf=None) -> dict[tuple[str, ...], object]:
    """{key_names(path): leaf} in tree-flatten order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {key_names(path): leaf for path, leaf in leaves}
