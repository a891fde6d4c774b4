"""The RL learner: trajectories -> padded batch -> jitted Dr. GRPO step with router replay.

The learner never imports the harness or the sampler: it reads `Trajectory` arrays only.

Router replay. A trajectory records, for every input position, the experts the sampler routed
it to (`expert_ids_TNK`, -1 where nothing was recorded, e.g. environment tokens). The
differentiated forward runs with those forced experts, the unrecorded positions taking the
learner's own picks inside each MoE layer: the gate weights still come from the learner's
router, so the router gets gradients. Each layer also reports where the replayed experts are
its own picks (`route_agreement`). With `rl.noreplay_metrics` (default) a no-gradient forward
with the learner's own routing gives the logprob mismatch *without* replay; pod configs turn it
off, so the step is the CPT step plus the reference's forward. With
`rl.replay_threshold` > 0 a forced expert whose score is below thr x the learner's own k-th
score is replaced by the learner's pick (c2jax.models.moe.select_experts).

Micro-batches. `rl.micro_batch_rows` > 0 runs the step as a scan over micro-batches of that many
rows and sums their gradients (one optimizer update per step, as before). On CPU the attention
scores are materialized, so a step's memory grows with rows x length^2: 24 rows of 1536 tokens took
9.9 GB whole and 4.3 GB in micro-batches of 8 (tiny model).

On a mesh (`Learner(..., mesh=...)`, the learner's own devices) the step runs exactly as CPT
does: `activate(cfg, mesh)`, params and optimizer state sharded by the logical rules and donated,
the batch over the data axes. Under context parallelism the model's inputs (tokens, targets,
positions, segment ids, forced expert ids) enter in the zigzag order, placed on the host as
CPT's `global_batch` does; the per-token loss inputs (mask, behaviour logprobs) stay in token order
and the forward's logprobs are permuted back to it inside the step (`_to_token_order`), so the
order-dependent terms (the KL to go) see the sequence as the sampler wrote it. The reference
params live on the learner's devices in the params' own shardings: the reference forward is one
more forward of the same program, with no transfer and no second program to keep in step.

Letters: B sequences, L padded length, N MoE layers, K experts per token, V vocab.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec

from c2jax.errors import ConfigError
from c2jax.models.moe import make_dropless
from c2jax.models.transformer import layer_counts, model_cfg
from c2jax.parallel.context import zigzag_order
from c2jax.parallel.mesh import active_logical_axes, axes_size, data_sharding, logical_to_mesh_spec
from c2jax.rl.advantages import apply_kl_penalty, broadcast_advantages
from c2jax.rl.losses import _masked_p99, loss_token_count, policy_loss
from c2jax.train.optimizer import make_optimizer
from c2jax.train.step import apply_if_finite, forward_nll, init_state, mtp_distill_terms, mtp_metrics, trains_mtp


def learner_cfg(cfg) -> ml_collections.ConfigDict:
    """A copy of cfg whose model routes exactly like the sampler (no dropped tokens) and carries
    rl.replay_threshold."""
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    m = cfg.model
    if m.num_experts:
        make_dropless(m)
        m.replay_threshold = float(cfg.rl.replay_threshold)
    return cfg


# ----------------------------------------------------------------------------- batches

# finish reasons of a rollout cut by a limit (rl.mask_overlong); "context_full": a segment filled
# the context window (summaries off or exhausted)
TRUNCATED = ("max_tokens", "max_turns", "max_new_tokens", "length", "max_len", "context_full")


def balance_order(lengths, num_shards: int) -> list[int]:
    """Order of sequences so that contiguous equal shards have balanced token counts (longest
    processing time first: each sequence goes to the lightest shard with room)."""
    n = len(lengths)
    if num_shards <= 1 or n % num_shards:
        return list(range(n))
    per = n // num_shards
    shards = [[] for _ in range(num_shards)]
    load = [0] * num_shards
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        s = min((s for s in range(num_shards) if len(shards[s]) < per), key=lambda s: load[s])
        shards[s].append(i)
        load[s] += lengths[i]
    return [i for sh in shards for i in sorted(sh)]


def build_batch(trajs, advantages_B, length_bucket: int = 64, weights_B=None, num_moe_layers: int = 0,
                top_k: int = 0, max_len: int | None = None, row_bucket: int = 1, row_multiple: int = 1,
                length_multiple: int = 1, row_divisor: int = 1) -> dict:
    """Next-token batch from trajectories (numpy). Position t predicts token t+1.

    Keys: inputs, targets, positions, segment_ids [B, L] int32; loss_mask [B, L] bool;
    behaviour_logp [B, L] f32; advantages [B] f32 (x weights_B); truncated [B] bool;
    forced_ids [N, B, L, K] int32 (-1 = not recorded) when num_moe_layers; num_sequences f32
    (the real rows: past row_bucket, B is rounded up to a multiple of it with empty rows, so
    batches of chained rollouts, whose sequence count varies, reuse a few compiled steps; then up
    to a multiple of row_multiple, the micro-batch size; always a multiple of row_divisor, the
    learner mesh's data-parallel size). L is a multiple of length_multiple (2 x CP: the zigzag
    chunks).
    """
    n_seq = len(trajs)
    B = n_seq if n_seq <= row_bucket else -(-n_seq // row_bucket) * row_bucket
    if row_multiple > 1 and B > row_multiple:  # noqa: SIM300 (B is a row count)
        B = -(-B // row_multiple) * row_multiple
    B = -(-B // row_divisor) * row_divisor
    advantages_B = np.pad(np.asarray(advantages_B, np.float32), (0, B - n_seq))
    if weights_B is not None:
        weights_B = np.pad(np.asarray(weights_B, np.float32), (0, B - n_seq))
    T_max = max(len(t.tokens_T) for t in trajs) - 1
    step = length_bucket * length_multiple // math.gcd(length_bucket, length_multiple)
    L = max(step, int(math.ceil(T_max / step)) * step)
    if max_len is not None and L > max_len:  # noqa: SIM300 (L is a length)
        L = max(max_len // length_multiple * length_multiple, length_multiple)
    b = {"inputs": np.zeros((B, L), np.int32), "targets": np.zeros((B, L), np.int32),
         "positions": np.tile(np.arange(L, dtype=np.int32), (B, 1)), "segment_ids": np.zeros((B, L), np.int32),
         "loss_mask": np.zeros((B, L), bool), "behaviour_logp": np.zeros((B, L), np.float32),
         "advantages": np.asarray(advantages_B, np.float32).copy(), "truncated": np.zeros((B,), bool),
         "num_sequences": np.float32(n_seq)}
    if weights_B is not None:
        b["advantages"] *= np.asarray(weights_B, np.float32)
    if num_moe_layers:
        b["forced_ids"] = np.full((num_moe_layers, B, L, top_k), -1, np.int32)
    for i, t in enumerate(trajs):
        n = min(len(t.tokens_T) - 1, L)
        b["inputs"][i, :n] = t.tokens_T[:n]
        b["targets"][i, :n] = t.tokens_T[1:n + 1]
        b["segment_ids"][i, :n] = 1
        b["loss_mask"][i, :n] = t.loss_mask_T[1:n + 1]
        b["behaviour_logp"][i, :n] = t.logprobs_T[1:n + 1]
        b["truncated"][i] = t.finish_reason in TRUNCATED
        ex = t.expert_ids_TNK
        if num_moe_layers and ex is not None and ex.ndim == 3 and ex.shape[1:] == (num_moe_layers, top_k):
            b["forced_ids"][:, i, :n] = np.transpose(ex[:n], (1, 0, 2))
    return b


# ----------------------------------------------------------------------------- the step


MODEL_KEYS = ("inputs", "targets", "positions", "segment_ids")  # model order (zigzag under CP)


def _context_order(length: int):
    """(order, inverse) of the zigzag layout of the active mesh's context axes; None when CP is off."""
    cp = axes_size(active_logical_axes("length"))
    if cp <= 1:
        return None
    order = zigzag_order(length, cp)
    return order, np.argsort(order)


def _to_token_order(x_BL):
    """A per-token array from the model's (zigzag) order back to token order."""
    zz = _context_order(x_BL.shape[1])
    return x_BL if zz is None else x_BL[:, zz[1]]


def _to_model_order(x_BL):
    zz = _context_order(x_BL.shape[1])
    return x_BL if zz is None else x_BL[:, zz[0]]


def _logp(cfg, params, batch, forced):
    """Logprobs of the batch's targets in token order, and the forward's aux (model order)."""
    nll, _, out = forward_nll(cfg, params, batch, forced, scale=1.0 / cfg.rl.temperature)
    return _to_token_order(-nll), out.aux


def _mismatch(logp_BL, behaviour_BL, mask_BL):
    on = mask_BL
    d = jnp.where(on, jnp.abs(logp_BL - behaviour_BL), 0.0)
    n = jnp.maximum(jnp.sum(on), 1)
    return jnp.sum(d) / n, _masked_p99(d, on)


ROW_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask", "behaviour_logp", "advantages",
            "truncated")


def _to_micro(x, M: int):
    """[B, ...] -> [M, B / M, ...]; micro-batch m holds rows m, m + M, m + 2M, ... (strided, so
    each micro-batch mixes long and short rows of the length-balanced order)."""
    return x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)


def _from_micro(x):
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def num_micro_batches(B: int, micro_batch_rows: int) -> int:
    """Micro-batches of a B-row batch (1 when rl.micro_batch_rows is 0 or >= B)."""
    if not micro_batch_rows or B <= micro_batch_rows:  # noqa: SIM300 (B is a row count)
        return 1
    if B % micro_batch_rows:
        raise ValueError(f"learner batch of {B} rows is not a multiple of rl.micro_batch_rows={micro_batch_rows}")
    return B // micro_batch_rows


def rl_train_step(cfg, optimizer, state, ref_params, batch):
    """One learner step. Returns (new_state, metrics).

    With rl.micro_batch_rows the batch runs as M micro-batches (lax.scan): the no-gradient
    forwards (the reference's logprobs; with rl.noreplay_metrics the learner's own routes too),
    then the differentiated forward whose gradients are summed. Every loss normalizer is a batch
    total computed up front, so the summed gradient equals the whole-batch gradient; metrics are
    computed once on the whole batch's logprobs. Router replay forces the recorded experts inside
    the differentiated forward; unrecorded positions take the learner's own picks there
    (c2jax.models.moe.select_experts), so replay itself needs no extra forward."""
    r = cfg.rl
    m = model_cfg(cfg)
    mask = batch["loss_mask"]
    B = mask.shape[0]
    M = num_micro_batches(B, int(r.get("micro_batch_rows", 0)))
    _, n_moe = layer_counts(m)
    replay = bool(r.router_replay) and n_moe > 0 and "forced_ids" in batch
    noreplay = replay and bool(r.get("noreplay_metrics", True))
    use_ref = r.kl_coef > 0
    rows = {k: _to_micro(batch[k], M) for k in ROW_KEYS}
    params_sg = jax.lax.stop_gradient(state["params"])

    def no_grad_forwards(_, b):
        out = {}
        if noreplay:
            out["own_logp"] = _logp(cfg, params_sg, b, None)[0]
        if use_ref:
            out["ref_logp"] = jax.lax.stop_gradient(_logp(cfg, ref_params, b, None)[0])
        return None, out

    pre = jax.lax.scan(no_grad_forwards, None, rows)[1] if (noreplay or use_ref) else {}
    metrics = {}
    forced_M = None
    if replay:
        rec = batch["forced_ids"]                                                # [N, B, L, K]
        forced_M = jnp.moveaxis(_to_micro(jnp.moveaxis(rec, 1, 0), M), 1, 2)     # [M, N, mb, L, K]
        recorded = jnp.all(rec >= 0, axis=-1)                                    # [N, B, L]
        tok = recorded & _to_model_order(mask)[None]
        metrics["replayed_fraction"] = jnp.sum(tok) / jnp.maximum(jnp.sum(mask) * n_moe, 1)
        tok_M = jnp.moveaxis(_to_micro(jnp.moveaxis(tok, 1, 0), M), 1, 2)        # [M, N, mb, L]
    if noreplay:
        mm, p99 = _mismatch(_from_micro(pre["own_logp"]), batch["behaviour_logp"], mask)
        metrics["logprob_mismatch_noreplay_mean"], metrics["logprob_mismatch_noreplay_p99"] = mm, p99
    n_seq = batch.get("num_sequences")
    # a batch without its zero-advantage rows carries the whole batch's loss-token count
    num_tokens = batch["loss_tokens"] if "loss_tokens" in batch else loss_token_count(mask, batch["truncated"], r)

    mtp = trains_mtp(cfg)

    def grad_micro(acc, xs):
        b, forced, ref_logp, tok = xs

        def loss_fn(params):
            if mtp:   # the heads distil the main head's (detached) distribution on the sampled tokens
                nll, _, out = forward_nll(cfg, params, b, forced, scale=1.0 / r.temperature, mtp=True,
                                          mtp_trunk_grad=bool(r.mtp_into_policy))
                logp, aux = _to_token_order(-nll), out.aux
                s_P, w_P = mtp_distill_terms(cfg, params, out, _to_model_order(b["loss_mask"]), b["segment_ids"],
                                             head_grad=bool(r.mtp_into_policy))
                mtp_loss = jnp.sum(s_P) / jnp.maximum(jnp.sum(w_P), 1.0)
                mtp_terms = (s_P, w_P)
            else:
                logp, aux = _logp(cfg, params, b, forced)
                mtp_loss, mtp_terms = jnp.float32(0), None
            if ref_logp is not None:
                adv = apply_kl_penalty(b["advantages"], logp, ref_logp, b["loss_mask"], r.kl_coef, r.kl_estimator,
                                       r.kl_to_go)
            else:
                adv = broadcast_advantages(b["advantages"], logp.shape)
            loss, _ = policy_loss(logp, b["behaviour_logp"], adv, b["loss_mask"], r, b["truncated"], None, n_seq,
                                  num_tokens=num_tokens)
            loss = loss + float(cfg.train.mtp_loss_weight) * mtp_loss / M if mtp else loss
            has_replaced.append("replaced_fraction" in aux)
            rf = jnp.mean(aux["replaced_fraction"]) if "replaced_fraction" in aux else jnp.float32(0)
            agree = jnp.sum(aux["route_agree"] & tok) if tok is not None else jnp.float32(0)
            return loss, (jax.lax.stop_gradient(logp), jax.lax.stop_gradient(adv), rf, agree,
                          jax.lax.stop_gradient(mtp_terms))

        (_, extras), g = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        return jax.tree.map(jnp.add, acc, g), extras

    has_replaced = []  # set while tracing: MoE forwards report the replay-replaced fraction
    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    grads, (logp_M, adv_M, replaced_M, agree_M, mtp_M) = jax.lax.scan(
        grad_micro, zeros, (rows, forced_M, pre.get("ref_logp"), tok_M if replay else None))
    if replay:
        metrics["route_agreement"] = jnp.sum(agree_M) / jnp.maximum(jnp.sum(tok), 1)
    ref_logp = _from_micro(pre["ref_logp"]) if use_ref else None
    loss, lm = policy_loss(_from_micro(logp_M), batch["behaviour_logp"], _from_micro(adv_M), mask, r,
                           batch["truncated"], ref_logp, n_seq, num_tokens=num_tokens)
    if any(has_replaced):
        lm["replay_replaced_fraction"] = jnp.mean(replaced_M)
    if mtp:
        lm.update(mtp_metrics(jnp.sum(mtp_M[0], axis=0), jnp.sum(mtp_M[1], axis=0)))
    lm["logp_mean"] = jnp.sum(jnp.where(mask, _from_micro(logp_M), 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    new_params, new_opt, finite, grad_norm = apply_if_finite(optimizer, state["params"], state["opt_state"],
                                                             grads, loss)
    new_state = {"params": new_params, "opt_state": new_opt, "step": state["step"] + 1, "rng": state["rng"]}
    metrics.update(lm)
    metrics["logprob_mismatch_mean"] = metrics.pop("logprob_mismatch_mean_abs")
    metrics["grad_norm"] = grad_norm
    metrics["skipped"] = (~finite).astype(jnp.int32)
    metrics["micro_batches"] = jnp.int32(M)
    return new_state, metrics


@functools.lru_cache(maxsize=8)
def _compiled_step(cfg_json: str):
    """One jitted step per config (one-device learners of equal configs share compiles)."""
    import json
    cfg = ml_collections.ConfigDict(json.loads(cfg_json))
    return make_rl_step(cfg, make_optimizer(cfg.train))


def make_rl_step(cfg, optimizer, state_shardings=None):
    """The jitted RL step (state donated). With state_shardings (c2jax.train.step.state_shardings)
    the new state keeps the learner mesh's layout; the batch and reference take the shardings of
    the arrays passed in (place_batch; the reference in the params' shardings). Call and lower it
    inside `activate(cfg, mesh)`."""
    fn = functools.partial(rl_train_step, cfg, optimizer)
    if state_shardings is None:
        return jax.jit(fn, donate_argnums=(0,))
    return jax.jit(fn, out_shardings=(state_shardings, None), donate_argnums=(0,))


def batch_shardings(cfg, mesh, batch) -> dict:
    """NamedSharding per key of an RL batch on the learner mesh: [B, L] arrays over the batch and
    length axes (as CPT's data), [B] arrays over the batch axes, forced_ids [N, B, L, K] over both,
    scalars replicated."""
    bl = data_sharding(cfg, mesh)
    b_axes, l_axes = tuple(bl.spec)[:2]
    out = {}
    for k, v in batch.items():
        nd = np.ndim(v)
        spec = {0: PartitionSpec(), 1: PartitionSpec(b_axes), 2: bl.spec}.get(nd)
        if k == "forced_ids":
            spec = PartitionSpec(None, b_axes, l_axes, None)
        out[k] = NamedSharding(mesh, spec)
    return out


def _spec_size(entry, mesh) -> int:
    """Devices a PartitionSpec entry (None, an axis or a tuple of axes) splits a dim over."""
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    return int(np.prod([mesh.shape[a] for a in names])) if names else 1


def context_size(cfg, mesh) -> int:
    """CP degree of the learner mesh (the axes `length` maps to)."""
    return _spec_size(logical_to_mesh_spec(PartitionSpec("length"), cfg, mesh)[0], mesh)


def place_batch(cfg, mesh, batch) -> dict:
    """A host batch (build_batch) on the learner mesh: the model's inputs (MODEL_KEYS, forced_ids)
    reordered to the zigzag layout when CP > 1 (on the host, as c2jax.parallel.distributed.
    global_batch does for CPT), every array put in its batch_shardings layout."""
    cp = context_size(cfg, mesh)
    b = dict(batch)
    if cp > 1:
        order = zigzag_order(b["inputs"].shape[1], cp)
        for k in MODEL_KEYS:
            b[k] = np.take(b[k], order, axis=1)
        if "forced_ids" in b:
            b["forced_ids"] = np.take(b["forced_ids"], order, axis=2)
    return jax.device_put(b, batch_shardings(cfg, mesh, b))


def batch_axis_size(cfg, mesh) -> int:
    """Devices the learner batch's rows are split over (B must be a multiple of it)."""
    return _spec_size(data_sharding(cfg, mesh).spec[0], mesh)


class Learner:
    """Holds the train state and the reference params; `step(trajs, advantages)` updates.

    mesh: the learner's devices (c2jax.rl.roles.rl_meshes); params, optimizer state, reference
    and batch are laid out on it by the config's logical rules. None: one device, as before."""

    def __init__(self, cfg, params, ref_params=None, seed: int = 0, mesh=None):
        self.cfg = learner_cfg(cfg)
        self.mesh = mesh
        m = self.cfg.model
        _, self.num_moe_layers = layer_counts(m)
        self.top_k = m.num_experts_per_tok if self.num_moe_layers else 0
        use_ref = self.cfg.rl.kl_coef > 0
        if mesh is None:
            self.optimizer = make_optimizer(self.cfg.train)
            params = jax.tree.map(jnp.copy, params)  # the state is donated at every step: keep the caller's arrays
            self.state = init_state(self.cfg, self.optimizer, params, seed)
            self.ref_params = params if ref_params is None else ref_params
            if use_ref:  # keep an independent copy: the state is donated
                self.ref_params = jax.tree.map(jnp.array, self.ref_params)
            self._step = _compiled_step(self.cfg.to_json())
            self.param_shardings = None
            self.rows_multiple = self.length_multiple = 1
            return
        from c2jax.models import param_shardings
        from c2jax.ops.target import target_of_mesh
        from c2jax.parallel.mesh import activate, validate_layout
        from c2jax.train.step import init_sharded_state
        validate_layout(self.cfg, dict(mesh.shape))
        with activate(self.cfg, mesh):
            self.param_shardings = p_sh = param_shardings(self.cfg, mesh)
            params = jax.device_put(params, p_sh)   # a copy where params already lie elsewhere
            ref = params if ref_params is None else jax.device_put(ref_params, p_sh)
            self.ref_params = jax.tree.map(jnp.copy, ref) if use_ref else None
            self.optimizer = make_optimizer(self.cfg.train, target_of_mesh(mesh), params)
            params = jax.tree.map(jnp.copy, params)  # donated below; the caller keeps its arrays
            self.state, self.state_shardings = init_sharded_state(self.cfg, self.optimizer, mesh, params, p_sh, seed)
            self._step = make_rl_step(self.cfg, self.optimizer, self.state_shardings)
        self.rows_multiple = batch_axis_size(self.cfg, mesh)
        micro = int(self.cfg.rl.micro_batch_rows)
        if micro % self.rows_multiple:
            raise ConfigError(f"rl.micro_batch_rows={micro} must be a multiple of the learner mesh's batch axes "
                              f"({self.rows_multiple} devices): each micro-batch is split over them")
        cp = context_size(self.cfg, mesh)
        self.length_multiple = 2 * cp if cp > 1 else 1

    @property
    def version(self) -> int:
        return int(self.state["step"])

    @property
    def params(self):
        return self.state["params"]

    @property
    def devices(self) -> list[int]:
        """Ids of the devices the learner runs on."""
        if self.mesh is None:
            return [jax.tree.leaves(self.state["params"])[0].devices().pop().id]
        return [int(d.id) for d in self.mesh.devices.flat]

    def make_batch(self, trajs, advantages_B, weights_B=None) -> dict:
        r = self.cfg.rl
        row_bucket = r.prompts_per_step * r.group_size
        skip = bool(r.get("skip_zero_advantage_rows", False))
        if skip:
            n_all = len(trajs)
            # the whole batch's normalizers: build_batch's own mask (length clamp included) counts them
            whole = build_batch(trajs, advantages_B, r.length_bucket, max_len=self.cfg.model.max_position_embeddings)
            loss_tokens = loss_token_count(whole["loss_mask"], whole["truncated"], r)
            adv_w = np.asarray(advantages_B, np.float32) * (1.0 if weights_B is None else np.asarray(weights_B))
            keep = np.flatnonzero(adv_w != 0.0)
            keep = keep if keep.size else np.arange(1)  # an all-zero batch still makes one (zero-gradient) step
            trajs = [trajs[i] for i in keep]
            advantages_B = np.asarray(advantages_B)[keep]
            weights_B = None if weights_B is None else np.asarray(weights_B)[keep]
            # kept rows round up to micro-batches (else quarters of the full batch), not to the full
            # batch: a step compiles once per multiple
            row_bucket = int(r.micro_batch_rows) or -(-n_all // 4)
        order = balance_order([len(t.tokens_T) for t in trajs], r.data_shards)
        trajs = [trajs[i] for i in order]
        adv = np.asarray(advantages_B)[order]
        w = None if weights_B is None else np.asarray(weights_B)[order]
        b = build_batch(trajs, adv, r.length_bucket, w, self.num_moe_layers, self.top_k,
                        max_len=self.cfg.model.max_position_embeddings,
                        row_bucket=row_bucket, row_multiple=int(r.micro_batch_rows),
                        length_multiple=self.length_multiple, row_divisor=self.rows_multiple)
        if skip:
            b["num_sequences"] = np.float32(n_all)
            b["loss_tokens"] = np.float32(loss_tokens)
        return b

    def step(self, trajs, advantages_B, weights_B=None) -> dict:
        batch = self.make_batch(trajs, advantages_B, weights_B)
        out = self.step_batch(batch)
        out["rows_skipped"] = len(trajs) - int(np.sum(batch["segment_ids"].any(axis=1)))
        return out

    def step_batch(self, batch) -> dict:
        """One step on a host batch (build_batch's dict)."""
        ref = self.ref_params if self.cfg.rl.kl_coef > 0 else None
        if self.mesh is None:
            self.state, metrics = self._step(self.state, ref, batch)
        else:
            from c2jax.parallel.mesh import activate
            with activate(self.cfg, self.mesh):
                self.state, metrics = self._step(self.state, ref, place_batch(self.cfg, self.mesh, batch))
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["batch_tokens"] = int(batch["segment_ids"].sum())
        out["batch_padded_len"] = int(batch["inputs"].shape[1])
        return out
