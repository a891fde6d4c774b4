"""The model's weights as the ops read them: the float params a layer declares, or the layout a
caller stored for it, and where each weight lives on the mesh.

The sampler keeps some weights in the layout its kernels read: pre-quantized containers
(pallas_kernels.QuantizedWeight / QuantizedExperts), the CPU kernels' packed panels, per-expert
buffers. They travel beside the params as `Weights(params, prepared)`: `prepared` mirrors the
params' paths and is its own Flax collection (PREPARED). A layer that finds its weight there
reads it instead of declaring the param (`weight`, `prepared_or`), so the model neither looks
for a layout nor decides anything from the type of a param leaf; which implementation reads the
layout is the op's choice (c2jax.ops). `shardings` places the params on a mesh by the config's
logical axis rules.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax

from c2jax.parallel.mesh import tree_shardings

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


def prepared_or(module, name: str, declare: Callable):
    """The weight stored prepared for `module` under `name`, else declare() (the module's params)."""
    return module.get_variable(PREPARED, name) if module.has_variable(PREPARED, name) else declare()


def weight(module, name: str, init, axes, shape, param_dtype, dtype=None):
    """`module`'s weight `name`: the form stored prepared for it as stored, else the float param
    declared with init, logical axes, shape and param_dtype (cast to dtype when given)."""
    def declare():
        w = module.param(name, nn.with_logical_partitioning(init, axes), shape, param_dtype)
        return w if dtype is None else w.astype(dtype)
    return prepared_or(module, name, declare)


def shardings(cfg, mesh, logical_tree, shapes_tree):
    """NamedSharding per weight leaf of shapes_tree on `mesh`, from its logical axes (logical_tree)
    through the config's rules."""
    return tree_shardings(cfg, mesh, logical_tree, shapes_tree)


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
