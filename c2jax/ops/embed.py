"""The embedding lookup op: under FSDP, without gathering the table.

The table [V, D] is FSDP-sharded over its D dim (the `embed` rule, e.g. fsdp x context x
expert: 64 ways on a v5p-1024). A plain `jnp.take` lets GSPMD all-gather the whole table on
every chip (163840 x 7168 bf16 = 2.2 GiB for Kimi) and, in the backward pass, scatter-add
the token gradients into a full f32 [V, D] buffer (4.4 GiB) before reduce-scattering it.
Here, inside `jax.shard_map`, each chip instead
 1. all-gathers the token ids of its D-group (the chips that hold the other D slices),
 2. looks them up in its local [V, D/W] slice,
 3. all-to-alls the rows back so every chip gets its own tokens with all D columns.
The backward pass is the transpose: all-to-all, scatter-add into the local [V, D/W] slice.

Letters: B batch, L length, V vocab, D model width, W D-group size, T local tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from c2jax.ops.registry import define_op
from c2jax.ops.target import Target, current_target
from c2jax.parallel.mesh import active_logical_axes, axes_size, divisible_axes, spec_entry

# which lookup runs follows from the mesh alone (no config field)
EMBED = define_op("embed", {"*": ("sharded_lookup", "take")}, field="the mesh (embed, batch and length axes)")


def _layout(B: int, L: int, D: int):
    """(D axes, batch axes, length axes) of the lookup on the active mesh."""
    d_axes = divisible_axes(D, active_logical_axes("embed"))
    l_axes = divisible_axes(L, active_logical_axes("length"))
    b_axes = divisible_axes(B, tuple(a for a in active_logical_axes("batch") if a not in l_axes))
    return d_axes, b_axes, l_axes


def _sharded_ok(target: Target, **spec):
    d_axes, b_axes, l_axes = spec["axes"]
    if axes_size(d_axes) <= 1:
        return "the table's D dim is not sharded"
    if not set(d_axes) <= set(b_axes + l_axes):
        # tokens replicated over part of the D-group (e.g. a one-row batch): GSPMD gathers the table
        return f"the tokens are not split over every axis of the table's D dim {d_axes}"
    return None


def embed_lookup(table_VD, tokens_BL, dtype):
    """Rows of `table_VD` for int tokens [B, L], cast to `dtype` -> [B, L, D]. Under an active
    mesh whose `embed` axes shard D, the lookup runs sharded (see the module docstring);
    otherwise it is `jnp.take`."""
    B, L = tokens_BL.shape
    axes = _layout(B, L, table_VD.shape[1])
    return EMBED.select("auto", current_target(), axes=axes).fn(table_VD, tokens_BL, dtype, *axes)


@EMBED.register("take", doc="jnp.take of the rows (GSPMD gathers a sharded table)")
def _take(table_VD, tokens_BL, dtype, d_axes, b_axes, l_axes):
    return jnp.take(table_VD, tokens_BL, axis=0).astype(dtype)


@EMBED.register("sharded_lookup", _sharded_ok,
                doc="each chip looks its D-group's tokens up in its own [V, D/W] slice, all-to-all back")
def _sharded_lookup(table_VD, tokens_BL, dtype, d_axes, b_axes, l_axes):
    D = table_VD.shape[1]

    def body(table, tok):
        b, l = tok.shape
        ids_WT = jax.lax.all_gather(tok.reshape(b * l), d_axes, axis=0, tiled=True)
        rows = jnp.take(table.astype(dtype), ids_WT, axis=0)                      # [W*T, D/W]
        x_TD = jax.lax.all_to_all(rows, d_axes, 0, 1, tiled=True)               # [T, D]
        return x_TD.reshape(b, l, D)

    tok = P(spec_entry(b_axes), spec_entry(l_axes))
    fn = jax.shard_map(body, in_specs=(P(None, spec_entry(d_axes)), tok),
                       out_specs=P(spec_entry(b_axes), spec_entry(l_axes), None))
    return fn(table_VD, tokens_BL)
