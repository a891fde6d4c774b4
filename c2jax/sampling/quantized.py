"""Pre-quantized inference weights: convert a params tree once into the kernels' quantized
storage (int8 / MXFP8 / NVFP4 values + scales), so each decode step reads the quantized bytes
instead of quantizing (or reading) float weights every step.

    qweights = quantize_params(params, "mxfp8", scope="all")   # c2jax.models.Weights
    forward(cfg, qweights, tokens)   # layers read their weight from qweights.prepared when it is there

What is converted (everything else, embeddings, norms, router, router bias, MLA kv_b_proj, the
output head, stays float):
  experts  MoE w_gate / w_up / w_down -> pallas_kernels.QuantizedExperts, the exact format the
           model's on-the-fly path (model.quant) builds every step: gmm on it is bit-identical
           (weights and per-token activations quantized, as in training's quantized forward).
  dense    with scope "all", every Linear kernel (attention q/k/v/o, MLA q/kv_a, dense and
           shared-expert MLPs, MTP eh_proj) -> pallas_kernels.QuantizedWeight, consumed by
           qmatmul in weight-only mode (activations bf16). Kernels whose contraction dim is not
           a multiple of the format's block are left float.
The containers go to the prepared collection at their params' paths (c2jax.ops.weights),
the float params stay in `params`. Stacked layer axes are kept (the quantizers are mapped over
them), so the scanned layers slice the containers like any other weight.

Letters: Y stacked layers, E experts, K contraction dim, N output dim.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from c2jax.ops.weights import Weights, separate
from pallas_kernels.qmatmul.reference import block_of

QUANTS = ("int8", "mxfp8", "nvfp4")
SCOPES = ("none", "experts", "all")
EXPERT_NAMES = ("w_gate", "w_up", "w_down")
FLOAT_MODULES = ("lm_head",)   # Linear kernels kept float under scope "all"


def _check(quant: str, scope: str) -> None:
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got quant={quant!r}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got scope={scope!r}")


def _vmapped(fn, x, base_ndim: int):
    """fn over the leading stacked-layer axes of x (x.ndim - base_ndim of them). lax.map, not vmap:
    under vmap the quantizers' exact_div barrier no longer hides the scale's broadcast, XLA turns
    the division into a reciprocal multiply, and scales drift by an ulp from the model's own."""
    for _ in range(x.ndim - base_ndim):
        fn = functools.partial(jax.lax.map, fn)
    return fn(x)


def _convert(tree, quant: str, scope: str, path=()):
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _convert(v, quant, scope, path + (k,))
        elif k in EXPERT_NAMES and path and path[-1] == "moe":
            out[k] = _quantize_experts(v, quant, "/".join(path + (k,)))
        elif (scope == "all" and k == "kernel" and not set(path) & set(FLOAT_MODULES)
              and v.shape[-2] % block_of(quant) == 0):
            out[k] = _vmapped(lambda w: pk.quantize_weight(w, quant), v, 2)
        else:
            out[k] = v
    return out


def _quantize_experts(w, quant: str, name: str):
    if w.shape[-2] % block_of(quant) or w.shape[-1] % 32:
        raise ValueError(f"{name} of shape {w.shape} cannot be stored as {quant}: gmm needs K divisible by "
                         f"{block_of(quant)} and N divisible by 32")
    return _vmapped(lambda x: pk.quantize_experts(x, quant), w, 3)


@functools.partial(jax.jit, static_argnames=("quant", "scope"))
def _quantize_jit(params, quant, scope):
    return separate(_convert(params, quant, scope))


def quantize_params(params, quant: str, scope: str = "experts") -> Weights:
    """Quantized storage form of a model params tree (see the module docstring): Weights whose
    prepared collection holds the quantized containers (scope 'none': none). Jitted: call once
    per weight version (Sampler.swap_params does)."""
    _check(quant, scope)
    if isinstance(params, Weights) or is_quantized(params):
        raise ValueError("params are already quantized; pass the float params")
    if scope == "none":
        return Weights(params, {})
    return _quantize_jit(params, quant, scope)


def is_quantized(tree) -> bool:
    """True when tree (params, Weights, or a part of one) holds a quantized container."""
    is_q = lambda x: isinstance(x, (pk.QuantizedWeight, pk.QuantizedExperts))  # noqa: E731
    return any(is_q(x) for x in jax.tree.leaves(tree, is_leaf=is_q))


def param_bytes(params) -> int:
    """Storage bytes of a params tree, sub-byte formats counted at their bit width (E2M1: 4 bits;
    JAX keeps float4 in one byte per value on the host, accelerators may pack it)."""
    total = 0
    for x in jax.tree.leaves(params):
        dt = jnp.dtype(x.dtype)
        bits = 4 if dt == jnp.float4_e2m1fn else 8 * dt.itemsize
        total += int(np.prod(x.shape)) * bits // 8
    return total


def quantized_shardings(qweights: Weights, float_shardings, mesh) -> Weights:
    """Shardings of quantize_params' Weights from the float params' shardings: the float params
    keep theirs; each quantized container's values and scales take their float weight's spec (a
    scale missing the contraction dim drops that entry; a dim the mesh axes do not divide stays
    whole)."""

    def spec_for(leaf, spec):
        spec = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
        if len(spec) > len(leaf.shape):          # channel scale [.., N]: no contraction dim
            spec = spec[:-2] + spec[-1:]
        size = lambda e: math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e))  # noqa: E731
        return P(*(e if e is None or d % size(e) == 0 else None for e, d in zip(spec, leaf.shape)))

    def like(tree, shardings, containers: bool):
        if isinstance(tree, dict):
            return {k: like(v, shardings[k], containers) for k, v in tree.items()}
        if not containers:
            return shardings
        return jax.tree.map(lambda leaf: NamedSharding(mesh, spec_for(leaf, shardings.spec)), tree)
    return Weights(like(qweights.params, float_shardings, False), like(qweights.prepared, float_shardings, True))
