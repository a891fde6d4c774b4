"""Views of one layer of the scanned model's stacked weights, for kernels that read it in place
(the CPU expert kernel): found by the ops, so the model passes them along without looking."""
from __future__ import annotations

from typing import NamedTuple

import jax


class LayerExperts(NamedTuple):
    """One layer's expert weights as a view into the stacks of all N layers (the scanned model's
    params): the kernels read layer `layer` of w_gate / w_up [N, E, D, F] and w_down [N, E, F, D] in
    place, where XLA would copy each layer's slice out for every call (~60 ms of the 89M bench's
    step). Gradients still flow through the per-layer weights given beside it."""

    w_gate_NEDF: jax.Array
    w_up_NEDF: jax.Array
    w_down_NEFD: jax.Array
    layer: jax.Array  # int32 []


def stacks_of(module, path: tuple[str, ...], names: tuple[str, ...], dtype) -> tuple | None:
    """The stacked params `names` at `path` under `module`'s params as stored, for a kernel that
    reads a layer of them in place; None at init, when any is stored prepared (absent from the
    params), or when they are not in the compute `dtype` (the layers then read cast copies)."""
    if module.is_initializing():
        return None
    tree = module.variables.get("params", {})
    for key in path:
        tree = tree.get(key, {})
    ws = tuple(tree.get(n) for n in names)
    if any(w is None or w.dtype != dtype for w in ws):
        return None
    return ws


def layer_view(stacks: tuple | None, layer) -> LayerExperts | None:
    """Layer `layer` of stacks_of's (w_gate, w_up, w_down) stacks as a LayerExperts; None without stacks."""
    return None if stacks is None else LayerExperts(*stacks, layer)
