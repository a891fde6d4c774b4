"""The decoder: embeddings, dense then MoE layers (each stack scanned), final norm, output head,
optional MTP heads; plus the functional API (init, forward, cache) the rest of c2jax uses.

Letters: B batch, L length, S cache slots, D model width, V vocab, K experts per token,
N MoE layers (stacked), Y any stacked layer count.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from c2jax.models.attention import GQAAttention, MLAAttention, init_layer_cache
from c2jax.ops import remat
from c2jax.ops import stacked as stacked_view
from c2jax.ops import sequence
from c2jax.models.layers import MLP, Linear, RMSNorm, dtype_of, kernels_of
from c2jax.models.moe import MoE, make_dropless
from c2jax.ops.weights import PREPARED, variables
from c2jax.ops.embed import embed_lookup


SCANNED_STACKS = ("dense_layers", "moe_layers")  # the params' layer-stacked subtrees (leading axis: layer)


def model_cfg(cfg):
    """Accept either a full config (with .model) or a model config."""
    return cfg.model if hasattr(cfg, "model") and not hasattr(cfg, "hidden_size") else cfg


def layer_counts(m) -> tuple[int, int]:
    """(dense layers, MoE layers); dense layers come first."""
    if m.num_experts == 0:
        return m.num_layers, 0
    return m.first_k_dense, m.num_layers - m.first_k_dense


def unrolled_stacks(cfg) -> tuple[str, ...]:
    """The SCANNED_STACKS compiled as straight-line code (scan_unroll >= their layer count): their
    gradients are made layer by layer and concatenated, where a loop writes them in place."""
    m = model_cfg(cfg)
    return tuple(name for name, n in zip(SCANNED_STACKS, layer_counts(m)) if 0 < n <= m.scan_unroll)


class Block(nn.Module):
    """Pre-norm decoder layer: attention then a dense MLP or an MoE. span: the attention's
    (cache slots read), None = all."""

    cfg: Any
    moe: bool
    span: int | None = None

    @nn.compact
    def __call__(self, x_BLD, positions_BL, segment_ids_BL, forced_ids_BLK=None, cache=None, stacked=None):
        m = self.cfg
        pdt = dtype_of(m.param_dtype)
        attn_cls = MLAAttention if m.attention == "mla" else GQAAttention
        h = RMSNorm(m.rms_norm_eps, "embed", pdt, kernels_of(m), name="attn_norm")(x_BLD)
        a, new_cache = attn_cls(m, span=self.span, name="attn")(h, positions_BL, segment_ids_BL, cache)
        x_BLD = nn.with_logical_constraint(x_BLD + a, ("batch", "length", "embed"))
        h = RMSNorm(m.rms_norm_eps, "embed", pdt, kernels_of(m), name="mlp_norm")(x_BLD)
        if self.moe:
            y, aux = MoE(m, name="moe")(h, forced_ids_BLK, stacked)
        else:
            y, aux = MLP(m.intermediate_size, dtype_of(m.dtype), pdt, m.init_std, kernels_of(m), name="mlp")(h), {}
        x_BLD = nn.with_logical_constraint(x_BLD + y, ("batch", "length", "embed"))
        return x_BLD, aux, new_cache


class ScanBody(nn.Module):
    """One layer as a scan body: carry x, per-layer inputs (forced ids, cache, layer index); the
    MoE layers' stacked expert weights (or None) broadcast to every layer."""

    cfg: Any
    moe: bool
    # Straight-line layers (the stack fully unrolled) need CSE prevented, or XLA may merge the
    # backward's rematerialized forward with the forward itself and keep its activations after all;
    # inside a loop the forward and backward are separate loops and nothing can merge.
    straight_line: bool = False

    @nn.compact
    def __call__(self, x_BLD, per_layer, positions_BL, segment_ids_BL, expert_stacks=None):
        forced, cache, layer = per_layer
        block = Block
        if self.cfg.remat != "none":
            block = nn.remat(Block, prevent_cse=self.straight_line, policy=remat.policy(self.cfg.remat))
        stacked = stacked_view.layer_view(expert_stacks, layer)
        x_BLD, aux, new_cache = block(self.cfg, self.moe, name="block")(
            x_BLD, positions_BL, segment_ids_BL, forced, cache, stacked)
        return x_BLD, (aux, new_cache)


def _stack(cfg, moe: bool, n: int, name: str):
    return nn.scan(
        ScanBody, variable_axes={"params": 0, PREPARED: 0}, split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=n, unroll=min(cfg.scan_unroll, n),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, moe, cfg.scan_unroll >= n, name=name)


class MTPHead(nn.Module):
    """DeepSeek-V3 multi-token prediction module: combine the previous depth's hidden state
    with the embedding of the token `depth` steps ahead, run one decoder layer. Returns the
    layer's hidden state (the next depth's input) and that state under the head's own output norm
    ("norm", DeepSeek-V3's shared_head.norm), which the shared output head reads."""

    cfg: Any
    moe: bool

    @nn.compact
    def __call__(self, h_BLD, next_emb_BLD, positions_BL, segment_ids_BL, cache=None):
        m = self.cfg
        pdt = dtype_of(m.param_dtype)
        hn = RMSNorm(m.rms_norm_eps, "embed", pdt, kernels_of(m), name="hnorm")(h_BLD)
        en = RMSNorm(m.rms_norm_eps, "embed", pdt, kernels_of(m), name="enorm")(next_emb_BLD)
        x = Linear(m.hidden_size, (None, "embed"), dtype=dtype_of(m.dtype), param_dtype=pdt, kernels=kernels_of(m),
                   init_std=m.init_std, name="eh_proj")(jnp.concatenate([en, hn], axis=-1))
        x, aux, new_cache = Block(m, self.moe, name="block")(x, positions_BL, segment_ids_BL, None, cache)
        normed = RMSNorm(m.rms_norm_eps, "embed", pdt, kernels_of(m), name="norm")(x)
        return (x, normed, aux, new_cache) if cache is not None else (x, normed, aux)


class MTPStep(nn.Module):
    """One MTP head on the KV-cache path (speculative drafting): the same param names as in
    Transformer (embed, mtp_{depth}, lm_head), so it applies to the model's params."""

    cfg: Any
    depth: int

    @nn.compact
    def __call__(self, h_BLD, ahead_BL, positions_BL, cache):
        m = self.cfg
        dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
        embed = self.param("embed", nn.initializers.normal(m.init_std), (m.vocab_size, m.hidden_size), pdt)
        next_emb = embed_lookup(embed, ahead_BL, dt)
        h, h_out, _, new_cache = MTPHead(m, layer_counts(m)[1] > 0, name=f"mtp_{self.depth}")(
            h_BLD, next_emb, positions_BL, jnp.ones_like(ahead_BL), cache)
        if m.tie_embeddings:
            logits = jnp.einsum("bld,vd->blv", h_out, embed.astype(dt), preferred_element_type=jnp.float32)
        else:
            logits = Linear(m.vocab_size, ("embed", "vocab"), dtype=dt, param_dtype=pdt, init_std=m.init_std,
                            kernels=kernels_of(m),
                            name="lm_head")(h_out)
        return logits.astype(jnp.float32), h, new_cache


class MTPShift(NamedTuple):
    """Static [L] indices along the length dim for MTP depth d, in the order the model sees the
    tokens (the zigzag layout under context parallelism): ahead[j] holds the token d after
    position j's (ahead_ok: inside the row), back[j] the position d before it (back_ok)."""

    ahead: Any
    ahead_ok: Any
    back: Any
    back_ok: Any


def mtp_shift(length: int, d: int) -> MTPShift:
    """MTPShift of depth d for rows of `length` tokens in the order the active mesh runs them
    (c2jax.ops.sequence.token_order: plain shifts outside context parallelism)."""
    order = sequence.token_order(length)
    inv = np.argsort(order)
    ahead, back = order + d, order - d
    return MTPShift(inv[np.minimum(ahead, length - 1)], ahead < length, inv[np.maximum(back, 0)], back >= 0)


class Transformer(nn.Module):
    """Decoder-only MoE transformer (Qwen3-MoE or DeepSeek-V3/Kimi layout by config)."""

    cfg: Any

    @nn.compact
    def __call__(self, tokens_BL, positions_BL, segment_ids_BL, forced_ids_NBLK=None, cache=None, head=True,
                 mtp=None, mtp_trunk_grad=True):
        """(logits f32 [B, L, V], aux, cache); with head=False the final-normed hidden states
        [B, L, D] in place of the logits and the MTP heads' normed states in aux["mtp_hidden"]
        [D, B, L, D] in place of aux["mtp_logits"]: the trainer's fused head + loss. mtp: run
        the MTP heads (default: with the head; never on the KV-cache path). mtp_trunk_grad=False:
        the heads read the trunk's states and the embeddings detached (their loss trains them alone)."""
        m = self.cfg
        dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
        embed = self.param("embed", nn.with_logical_partitioning(nn.initializers.normal(m.init_std),
                                                                 ("vocab", "embed")),
                           (m.vocab_size, m.hidden_size), pdt)
        x = embed_lookup(embed, tokens_BL, dt)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        n_dense, n_moe = layer_counts(m)
        aux, new_cache = {}, {}
        cache = cache or {}
        if n_dense:
            x, (_, c) = _stack(m, False, n_dense, SCANNED_STACKS[0])(
                x, (None, cache.get("dense"), jnp.arange(n_dense, dtype=jnp.int32)), positions_BL, segment_ids_BL,
                None)
            new_cache["dense"] = c
        if n_moe:
            # the expert stacks as stored, for a kernel that reads a layer of them in place (c2jax.ops.stacked)
            stacks = stacked_view.stacks_of(self, (SCANNED_STACKS[1], "block", "moe"), ("w_gate", "w_up", "w_down"), dt)
            x, (moe_aux, c) = _stack(m, True, n_moe, SCANNED_STACKS[1])(
                x, (forced_ids_NBLK, cache.get("moe"), jnp.arange(n_moe, dtype=jnp.int32)), positions_BL,
                segment_ids_BL, stacks)
            new_cache["moe"] = c
            aux.update(moe_aux)
        hidden_BLD = x
        self.sow("intermediates", "hidden", hidden_BLD)  # read by speculative decoding (MTP drafts)
        final_norm = RMSNorm(m.rms_norm_eps, "embed", pdt, kernels_of(m), name="final_norm")
        run_mtp = bool(m.num_mtp_layers) and not cache and (head if mtp is None else mtp)
        if run_mtp:
            mtp_normed, mtp_segments, h = [], [], hidden_BLD
            mtp_embed = embed
            if not mtp_trunk_grad:
                h, mtp_embed = jax.lax.stop_gradient(h), jax.lax.stop_gradient(embed)
            for d in range(1, m.num_mtp_layers + 1):
                shift = mtp_shift(tokens_BL.shape[1], d)
                ahead_BL = jnp.where(shift.ahead_ok, jnp.take(tokens_BL, shift.ahead, axis=1), 0)
                next_emb = embed_lookup(mtp_embed, ahead_BL, dt)
                h, normed, _ = MTPHead(m, n_moe > 0, name=f"mtp_{d}")(h, next_emb, positions_BL, segment_ids_BL)
                # each position gets the prediction made d tokens before it: the same token as the
                # main head's there (the hidden state moves, not the [B, L, V] logits)
                mtp_normed.append(jnp.take(normed, shift.back, axis=1))
                mtp_segments.append(jnp.where(shift.back_ok, jnp.take(segment_ids_BL, shift.back, axis=1), -1))
            aux["mtp_segment_ids"] = jnp.stack(mtp_segments)
        if not head:
            if run_mtp:
                aux["mtp_hidden"] = jnp.stack(mtp_normed)
            return final_norm(hidden_BLD), aux, None
        head = None if m.tie_embeddings else Linear(m.vocab_size, ("embed", "vocab"), dtype=dt,
                                                    kernels=kernels_of(m),
                                                    param_dtype=pdt, init_std=m.init_std, name="lm_head")

        def logits_of(h_BLD):
            return project(final_norm(h_BLD))

        def project(h):
            if head is None:
                out = jnp.einsum("bld,vd->blv", h, embed.astype(dt), preferred_element_type=jnp.float32)
            else:
                out = head(h)
            return nn.with_logical_constraint(out.astype(jnp.float32), ("batch", "length", "vocab"))

        logits = logits_of(hidden_BLD)
        if run_mtp:
            aux["mtp_logits"] = jnp.stack([project(h) for h in mtp_normed])
        return logits, aux, (new_cache if cache else None)


# ----------------------------------------------------------------------------- functional API


class ForwardOutput(NamedTuple):
    logits: jax.Array                 # float32 [B, L, V]
    aux: dict                         # expert_ids [N, B, L, K], expert_load [N, E], losses, mtp_logits
    #                                   [D, B, L, V] (depth d at t: the prediction made at t - d, of the
    #                                   main head's token at t), mtp_segment_ids [D, B, L] (-1: none)
    cache: Any = None


def _defaults(tokens_BL, positions_BL, segment_ids_BL):
    B, L = tokens_BL.shape
    if positions_BL is None:
        positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    if segment_ids_BL is None:
        segment_ids_BL = jnp.ones((B, L), jnp.int32)
    return positions_BL.astype(jnp.int32), segment_ids_BL.astype(jnp.int32)


def init_params(cfg, rng, with_logical_axes: bool = False):
    """Random params (plain pytree). With with_logical_axes, also the logical PartitionSpec tree."""
    m = model_cfg(cfg)
    tokens = jnp.zeros((1, 8), jnp.int32)
    pos, seg = _defaults(tokens, None, None)
    boxed = Transformer(m).init(rng, tokens, pos, seg)["params"]
    params = nn.meta.unbox(boxed)
    if with_logical_axes:
        return params, nn.get_partition_spec(boxed)
    return params


def logical_axes(cfg):
    """The logical PartitionSpec tree of the params, without allocating them."""
    m = model_cfg(cfg)
    tokens = jnp.zeros((1, 8), jnp.int32)
    pos, seg = _defaults(tokens, None, None)
    boxed = jax.eval_shape(lambda r: Transformer(m).init(r, tokens, pos, seg)["params"], jax.random.key(0))
    return nn.get_partition_spec(boxed)


def abstract_params(cfg):
    """ShapeDtypeStructs of the params (for AOT compiles and checkpoint restores)."""
    m = model_cfg(cfg)
    return jax.eval_shape(lambda r: init_params(m, r), jax.random.key(0))


def dropless(m):
    """Model config m, or a copy of it whose MoE dispatch drops no assignment."""
    if getattr(m, "moe_dispatch", "dropless") == "dropless":
        return m
    m = ml_collections.ConfigDict(m.to_dict())
    make_dropless(m)
    return m


def forward(cfg, params, tokens_BL, positions_BL=None, segment_ids_BL=None, *,
            forced_expert_ids=None, return_aux: bool = False, head: bool = True, train_dispatch: bool = False,
            mtp: bool | None = None, mtp_trunk_grad: bool = True):
    """Logits float32 [B, L, V] for int32 tokens [B, L]; with return_aux a ForwardOutput.
    params: the params dict, or c2jax.ops.weights.Weights (some weights stored prepared).

    forced_expert_ids: int [N_moe, B, L, K] replays recorded routing (router replay).
    head=False: the final-normed hidden states [B, L, D] in place of the logits, for losses that
    apply the output head themselves (c2jax.train.head_loss); the MTP heads run when `mtp` (default:
    head) and the model has them, their outputs in aux ("mtp_logits", or with head=False
    "mtp_hidden"; "mtp_segment_ids"); mtp_trunk_grad=False: their inputs detached from the trunk.
    Dropless unless train_dispatch (the training step's opt-in to model.moe_dispatch="capacity")."""
    m = model_cfg(cfg) if train_dispatch else dropless(model_cfg(cfg))
    tokens_BL = jnp.asarray(tokens_BL, jnp.int32)
    positions_BL, segment_ids_BL = _defaults(tokens_BL, positions_BL, segment_ids_BL)
    logits, aux, _ = Transformer(m).apply(variables(params), tokens_BL, positions_BL, segment_ids_BL,
                                          forced_expert_ids, cache={}, head=head, mtp=mtp,
                                          mtp_trunk_grad=mtp_trunk_grad)
    if return_aux:
        return ForwardOutput(logits, aux)
    return logits


def head_weight(cfg, params):
    """(w, tied): the output head's weight, lm_head [D, V] or the tied embedding [V, D]."""
    if model_cfg(cfg).tie_embeddings:
        return params["embed"], True
    return params["lm_head"]["kernel"], False


def init_cache(cfg, batch: int, max_len: int, dtype=None) -> dict:
    """Empty stacked KV caches {"dense": ..., "moe": ...} for `batch` rows of `max_len` slots."""
    m = model_cfg(cfg)
    dtype = dtype or dtype_of(m.dtype)
    n_dense, n_moe = layer_counts(m)
    one = init_layer_cache(m, batch, max_len, dtype)
    cache = {}
    if n_dense:
        cache["dense"] = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_dense,) + a.shape), one)
    if n_moe:
        cache["moe"] = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_moe,) + a.shape), one)
    return cache


def forward_with_cache(cfg, params, tokens_BL, positions_BL, cache, *, forced_expert_ids=None):
    """Prefill or decode: write the tokens' keys at their positions, attend over the cache.
    Returns ForwardOutput(logits, aux, new_cache). Rows may be at different positions."""
    m = dropless(model_cfg(cfg))
    tokens_BL = jnp.asarray(tokens_BL, jnp.int32)
    positions_BL = jnp.asarray(positions_BL, jnp.int32)
    seg = jnp.ones_like(tokens_BL)
    logits, aux, new_cache = Transformer(m).apply(variables(params), tokens_BL, positions_BL, seg,
                                                  forced_expert_ids, cache=cache)
    return ForwardOutput(logits, aux, new_cache)


def init_mtp_cache(cfg, batch: int, max_len: int, dtype=None) -> list:
    """Empty KV caches of the MTP heads' layers, one per depth (for speculative decoding)."""
    m = model_cfg(cfg)
    return [init_layer_cache(m, batch, max_len, dtype or dtype_of(m.dtype)) for _ in range(m.num_mtp_layers)]


def forward_with_cache_hidden(cfg, params, tokens_BL, positions_BL, cache):
    """forward_with_cache plus the final hidden states [B, L, D] (before the final norm)."""
    m = dropless(model_cfg(cfg))
    tokens_BL = jnp.asarray(tokens_BL, jnp.int32)
    (logits, aux, new_cache), inter = Transformer(m).apply(
        variables(params), tokens_BL, jnp.asarray(positions_BL, jnp.int32), jnp.ones_like(tokens_BL), None,
        cache=cache, mutable=["intermediates"])
    return ForwardOutput(logits, aux, new_cache), inter["intermediates"]["hidden"][0]


def mtp_forward_with_cache(cfg, params, depth: int, h_BLD, ahead_BL, positions_BL, cache):
    """MTP head `depth` (1-based) on the cache path: hidden h_BLD of depth-1 (the main model's for
    depth 1) and the tokens `depth` steps ahead -> (logits f32 [B, L, V], hidden [B, L, D], cache)."""
    m = dropless(model_cfg(cfg))
    if not 1 <= depth <= m.num_mtp_layers:
        raise ValueError(f"MTP depth {depth} out of range: model.num_mtp_layers={m.num_mtp_layers}")
    return MTPStep(m, depth).apply(variables(params), h_BLD, jnp.asarray(ahead_BL, jnp.int32),
                                   jnp.asarray(positions_BL, jnp.int32), cache)


# ----------------------------------------------------------------------------- accounting


def param_count(cfg) -> dict[str, int]:
    """Total and active (per token) parameter counts; embeddings counted once; "mtp" / "mtp_active":
    the MTP heads' own params, all / per token (in total and active; they share the embedding and
    output head)."""
    m = model_cfg(cfg)
    shapes = abstract_params(m)
    total = sum(x.size for x in jax.tree.leaves(shapes))
    n_dense, n_moe = layer_counts(m)
    inactive = mtp_inactive = 0
    if n_moe:
        expert = 3 * m.hidden_size * m.moe_intermediate_size
        inactive = n_moe * (m.num_experts - m.num_experts_per_tok) * expert
        mtp_inactive = m.num_mtp_layers * (m.num_experts - m.num_experts_per_tok) * expert
        inactive += mtp_inactive
    embed = m.vocab_size * m.hidden_size
    mtp = sum(x.size for k, v in shapes.items() if k.startswith("mtp_") for x in jax.tree.leaves(v))
    return {"total": int(total), "active": int(total - inactive), "embedding": int(embed), "mtp": int(mtp),
            "mtp_active": int(mtp - mtp_inactive)}


def _attention_flops(m, layers: int, seq_len: int) -> float:
    if m.attention == "mla":
        qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    else:
        qk = v = m.head_dim
    return 2 * layers * m.num_heads * (qk + v) * seq_len / 2  # causal: half the keys on average


def flops_per_token(cfg, seq_len: int, training: bool = True, mtp: bool = False) -> float:
    """Matmul FLOPs per token (6N for training, 2N for inference, N = active non-embedding
    params incl. the output head) plus causal attention score/value FLOPs. mtp: the MTP heads run
    too, each its layer, its attention and one more output-head product; without them their params
    are not counted (a training step's choice: c2jax.train.step.train_flops_per_token)."""
    m = model_cfg(cfg)
    counts = param_count(m)
    n = counts["active"] - counts["embedding"] + (counts["embedding"] if m.tie_embeddings else 0)
    n -= counts["mtp_active"]
    attn = _attention_flops(m, m.num_layers, seq_len)
    if mtp and m.num_mtp_layers:
        n += counts["mtp_active"] + m.num_mtp_layers * m.vocab_size * m.hidden_size
        attn += _attention_flops(m, m.num_mtp_layers, seq_len)
    mult = 3 if training else 1
    return float(mult * (2 * n + attn))


def context_prefill(cfg, params, tokens_BL, positions_BL, cache):
    """`forward_with_cache` on rows laid out for the active mesh (c2jax.ops.sequence.prefill_layout:
    under context parallelism padded to a multiple of 2*CP and zigzag-permuted, so the attention
    takes its CP prefill path) -> ForwardOutput(logits [B, L, V] in the original token order, aux,
    new cache). aux's per-token arrays (expert_ids [N, B, L, K]) come back in the original order
    too; aggregate stats (expert_load) include any pad tokens."""
    S = jax.tree.leaves(cache)[0].shape[2]   # stacked caches: [layers, B, S, ...]
    tokens_BL, positions_BL, restore = sequence.prefill_layout(tokens_BL, positions_BL, S)
    out = forward_with_cache(cfg, params, tokens_BL, positions_BL, cache)
    aux = dict(out.aux)
    if "expert_ids" in aux:
        aux["expert_ids"] = restore(aux["expert_ids"], axis=2)
    return ForwardOutput(restore(out.logits, axis=1), aux, out.cache)
