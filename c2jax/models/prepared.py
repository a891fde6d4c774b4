"""Weights a caller stored in another layout than the float params the layers declare.

The sampler keeps some weights in the layout its kernels read: pre-quantized containers
(pallas_kernels.QuantizedWeight / QuantizedExperts), the CPU kernels' packed panels, per-expert
buffers. They travel beside the params as `Weights(params, prepared)`: `prepared` mirrors the
params' paths and is its own Flax collection (PREPARED). A layer that finds its weight there
reads it instead of declaring the param, so the model decides nothing from the type of a
param leaf; which layout runs is the op's choice (c2jax.ops).
"""
from __future__ import annotations

import dataclasses

import jax

PREPARED = "prepared"   # the Flax collection of prepared weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """Float params (without the weights stored prepared) and the prepared weights at their paths."""

    params: dict
    prepared: dict


def variables(weights) -> dict:
    """Flax variables for a params dict or a Weights."""
    if isinstance(weights, Weights):
        return {"params": weights.params, PREPARED: weights.prepared}
    return {"params": weights}


def prepared_weight(module, name: str):
    """The weight stored prepared for `module` under `name`, or None (the module declares the param)."""
    return module.get_variable(PREPARED, name) if module.has_variable(PREPARED, name) else None


def separate(tree) -> Weights:
    """A params tree in which some weights were replaced by prepared forms (anything that is not
    an array: a kernel's container, a tuple of per-expert buffers) -> Weights, the prepared ones
    at the same paths of `prepared`; dicts and lists keep their structure on both sides."""
    def split(t):
        if isinstance(t, dict):
            parts = {k: split(v) for k, v in t.items()}
            return ({k: p for k, (p, _) in parts.items() if p is not _NONE},
                    {k: q for k, (_, q) in parts.items() if q is not _NONE})
        if isinstance(t, list):
            parts = [split(v) for v in t]
            return [{} if p is _NONE else p for p, _ in parts], [{} if q is _NONE else q for _, q in parts]
        return (t, _NONE) if hasattr(t, "ndim") else (_NONE, t)
    params, prepared = split(tree)
    return Weights(params, prepared)


_NONE = object()
