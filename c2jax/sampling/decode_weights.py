"""The sampler's copy of the weights, in the layouts its kernels read, and the decode step that
reads them.

One place decides the layout (prepare):
  "float"      the model's float params; prefill and decode run the scanned model.
  "quantized"  model.quant with quant_scope "experts" / "all": the quantized containers in the
               prepared collection (c2jax.sampling.quantized); the scanned model reads them.
  "split"      the unrolled decode step's per-layer, per-expert buffers (c2jax.sampling.unrolled),
  "packed"     or with the CPU kernels' packed experts and matrices; prefill keeps the float params.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from c2jax.models import transformer as tfm
from c2jax.ops.registry import record
from c2jax.sampling import quantized, unrolled

LAYOUTS = ("float", "quantized", "split", "packed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
    """model: what prefill (and the scanned decode) reads, a params dict or c2jax.models.Weights;
    split: unrolled.split_params' Weights for the unrolled decode step, or None; layout (static)."""

    model: Any
    split: Any
    layout: str = dataclasses.field(metadata=dict(static=True))


def prepare(m, params, *, quant_scope: str = "none", split_decode: bool = False, mesh=None) -> DecodeWeights:
    """The sampler's weights for model config m from float params (see the module docstring)."""
    if quant_scope != "none" and m.quant != "none":
        return DecodeWeights(quantized.quantize_params(params, m.quant, quant_scope), None, "quantized")
    if split_decode:
        return DecodeWeights(params, unrolled.split_params(m, params, mesh), unrolled.decode_layout(m, mesh))
    return DecodeWeights(params, None, "float")


def decode_step(m, w: DecodeWeights, tokens_BL, positions_BL, cache, span: int | None = None) -> tfm.ForwardOutput:
    """One decode forward on the cache: the unrolled step over w.split (per-layer caches; span:
    attention reads slots [0, span)), else the model's scanned forward_with_cache on w.model.
    The layout is recorded with the ops' choices (c2jax.ops.record_choices: "decode_layout")."""
    record("decode_layout", w.layout)
    if w.split is not None:
        return unrolled.decode_step(m, w.split, tokens_BL, positions_BL, cache, span)
    return tfm.forward_with_cache(m, w.model, tokens_BL, positions_BL, cache)
