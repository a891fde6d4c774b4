"""Decode-time MoE dispatch by weight gather: when a step routes fewer token-expert pairs
than there are experts (T * K < E, e.g. batch-1 decode in the agent harness), read only the
chosen experts' weights ([T, K, D, F] gathers) instead of running every expert (the capacity
and CPU-ragged paths read all E experts per step).

Installed around the sampler's model calls with `flax.linen.intercept_methods`, so
c2jax.models stays untouched; the router (`select_experts`), the combine weights and the aux
outputs are the model's own, only the expert matmuls change. Falls back to the model's MoE
for larger steps, router replay (forced ids) and quantized experts.

Letters: B batch, L length, T tokens, D width, E experts, K top-k, F expert width.
"""
from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2jax.models.layers import dtype_of
from c2jax.models.moe import MoE, select_experts


def _gather_moe(module, x_BLD):
    m = module.cfg
    p = module.variables["params"]
    dt = dtype_of(m.dtype)
    B, L, D = x_BLD.shape
    E, K = m.num_experts, m.num_experts_per_tok
    x_TD = x_BLD.reshape(B * L, D)
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), p["router"].astype(jnp.float32))
    ids_TK, weights_TK, scores_TE, replaced_TK = select_experts(logits_TE, p.get("router_bias"), m, None)
    x_TD = x_TD.astype(dt)
    w_gate = p["w_gate"][ids_TK].astype(dt)   # [T, K, D, F]: only the chosen experts are read
    w_up = p["w_up"][ids_TK].astype(dt)
    w_down = p["w_down"][ids_TK].astype(dt)   # [T, K, F, D]
    f32 = jnp.float32
    gate = jnp.einsum("td,tkdf->tkf", x_TD, w_gate, preferred_element_type=f32).astype(dt)
    up = jnp.einsum("td,tkdf->tkf", x_TD, w_up, preferred_element_type=f32).astype(dt)
    y_TKD = jnp.einsum("tkf,tkfd->tkd", nn.silu(gate) * up, w_down, preferred_element_type=f32).astype(dt)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD.astype(f32), weights_TK.astype(f32)).astype(dt)
    y_BLD = y_TD.reshape(B, L, D)
    if m.num_shared_experts:
        s = p["shared"]
        h = x_BLD.astype(dt)
        g = h @ s["gate"]["kernel"].astype(dt)
        u = h @ s["up"]["kernel"].astype(dt)
        y_BLD = y_BLD + (nn.silu(g) * u) @ s["down"]["kernel"].astype(dt)
    load_E = jnp.bincount(ids_TK.reshape(-1), length=E).astype(f32)
    probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    aux = {
        "expert_ids": ids_TK.reshape(B, L, K).astype(jnp.int32),
        "expert_load": load_E,
        "load_balance_loss": E * jnp.sum(load_E / (B * L * K) * jnp.mean(probs_TE, axis=0)),
        "router_z_loss": jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2),
        "dropped_fraction": jnp.zeros((), f32),
        "replaced_fraction": jnp.mean(replaced_TK.astype(f32)),
    }
    return y_BLD.astype(x_BLD.dtype), aux


def _interceptor(next_fun, args, kwargs, context):
    mod = context.module
    if isinstance(mod, MoE) and context.method_name == "__call__":
        m = mod.cfg
        x = args[0]
        forced = args[1] if len(args) > 1 else kwargs.get("forced_ids_BLK")
        if (forced is None and m.quant == "none"
                and x.shape[0] * x.shape[1] * m.num_experts_per_tok < m.num_experts):
            return _gather_moe(mod, x)
    return next_fun(*args, **kwargs)


def gather_dispatch(enabled: bool = True):
    """Context manager: trace the model with gather dispatch for small MoE steps."""
    return nn.intercept_methods(_interceptor) if enabled else contextlib.nullcontext()
