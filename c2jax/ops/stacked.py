"""Views of one layer of the scanned model's stacked weights, for kernels that read it in place."""
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
