"""What each decoder layer keeps for the backward pass (model.remat, c2jax.config.REMAT_POLICIES):
the model and the kernels name the activations (`tag`), this module maps a policy to the names it
keeps.

  none                    no rematerialization: every residual is kept
  full                    only the layer's input; the backward reruns the whole layer
  save_qkv_proj           also the q / k / v projections (MaxText's save_qkv_proj)
  save_attention          also the attention kernel's output and log-sum-exp: no attention kernel
                          reruns, only norms, RoPE, the output projection and the MLP / MoE
  save_matmuls            every projection's output: q / k / v, attention output projection, MLP
                          and expert gate / up / down (MaxText's minimal); the attention kernel reruns
  save_matmuls_attention  save_matmuls plus the attention kernel's residuals: only norms, RoPE and
                          elementwise ops rerun
  save_dots               jax's dots_with_no_batch_dims_saveable: every XLA matmul without batch
                          dims; Pallas kernels (attention, grouped matmuls) rerun
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from c2jax.config import REMAT_POLICIES
from pallas_kernels.flash_attention.ops import RESIDUAL_NAMES as FLASH_RESIDUALS

QKV_PROJ = "qkv_proj"   # q / k / v projections (GQA); the q and the kv-latent projections (MLA)
OUT_PROJ = "out_proj"   # the attention's output projection
MLP_IN = "mlp_in"       # MLP / expert gate and up projections
MLP_OUT = "mlp_out"     # MLP / expert down projection

_MATMULS = (QKV_PROJ, OUT_PROJ, MLP_IN, MLP_OUT)
SAVED_NAMES = {"full": (), "save_qkv_proj": (QKV_PROJ,), "save_attention": (QKV_PROJ, *FLASH_RESIDUALS),
               "save_matmuls": _MATMULS, "save_matmuls_attention": (*_MATMULS, *FLASH_RESIDUALS)}


def tag(x, name: str):
    """x, named for the remat policies (a no-op outside jax.checkpoint)."""
    return checkpoint_name(x, name)


def policy(name: str):
    """The jax.checkpoint policy of model.remat `name`; None for "none" (no checkpoint)."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"model.remat={name!r}: one of {REMAT_POLICIES}")
    if name == "none":
        return None
    if name == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[name])
