"""Side-by-side TPU ahead-of-time compile of Tunix's GRPO policy update and c2jax's RL learner step,
same model (Qwen3-30B-A3B), same slice, same batch x sequence, f32 params + AdamW moments, bf16
compute, full remat; on this CPU machine (libtpu compiles for a topology from
jax.experimental.topologies; nothing runs on a TPU).

    bash experiments/reference/setup_tunix_env.sh              # .venv-tunix (or $TUNIX_VENV)
    .venv-tunix/bin/python experiments/bench/tunix_rl_aot.py --side tunix --compiles L2,L4,full
    .venv/bin/python experiments/bench/tunix_rl_aot.py --side c2jax --compiles L2,L4,full
    python3 experiments/bench/tunix_rl_aot.py --table experiments/results/tunix/*.json   # no jax needed

Each run writes OUT_DIR/DATE_SIDE_POINT.json (one compile per entry of --compiles: "L<n>" is the
model cut to n decoder layers with its layers unrolled, "full" the whole depth as the side trains
it: Tunix's layers are a Python loop (always unrolled), c2jax's are scanned).

Tunix side (google-tunix, in its own venv): the model is tunix.models.qwen3.model.Qwen3 with
ModelConfig.qwen3_30b_a3b() (dtype bf16, param_dtype f32, remat_config DECODER = the whole decoder
layer rematerialized, use_flash_attention True = jax's splash attention kernel), built with
nnx.eval_shape and sharded by the `sharding` metadata Tunix puts on its params
(ShardingConfig.get_default_sharding(): FSDP over 'fsdp', tensor parallel over 'tp'), resolved on
the mesh by nnx.get_named_sharding exactly as tunix.models.safetensors_loader does; mesh
('fsdp', 'tp') = (chips, 1), Tunix's data sharding ('fsdp',). The step is Tunix's own
PeftTrainer._train_step (nnx.value_and_grad of the loss, optax.global_norm, nnx.Optimizer.update)
with the loss GRPOLearner installs (tunix.rl.algo_core.grpo_loss_fn, GRPOConfig defaults: beta 0.04,
kl_loss_mode 'kl', epsilon 0.2, loss_agg_mode 'sequence-mean-token-mean') on a TrainExample with
prompt / completion ids and masks, advantages [B], old per-token logps and reference per-token logps
[B, completion]; the optimizer optax.chain(clip_by_global_norm(1.0), adamw(b1 0.9, b2 0.95, wd 0.1)),
state donated, jitted over the abstract state (Tunix nnx.jit's the same function over the live
model and optimizer).
  Tunix picks its MoE and sharding path at trace time from `jax.devices()[0].platform` (the
  default backend's devices, CPU on this machine) and the legacy `with mesh:` context
  (pxla.thread_resources): on CPU it runs a dense one-hot loop over all 128 experts and drops every
  activation sharding constraint. A TPU host takes the megablox path (shard_map + ragged
  all-to-all over 'fsdp' + megablox.gmm). So that the program compiled here is the one a TPU host
  compiles, the bench hands Tunix's qwen3 module a `jax` whose devices() are the topology's TPU
  devices (only that module's name is rebound; `--tunix-cpu-path` keeps Tunix's CPU choice).
  Tunix computes the reference model's logps in a separate program (RLCluster.
  get_ref_per_token_logps: common.compute_per_token_logps, no gradient); `--ref-forward` also
  compiles that program for the same batch so its cost can be added to the update's.

c2jax side (the project's .venv): c2jax.rl.learner.rl_train_step through make_rl_step, lowered by
c2jax.tools.compile_check.compile_rl_step on the learner cfg (learner_cfg: dropless MoE) of the
config experiments/bench/tpu_aot.py uses for its point qwen3_30b_a3b-fsdp64 (FSDP 64, flash
attention, grouped-matmul MoE, remat full), with rl.kl_coef 1e-3 > 0 (the reference's forward in
the same program, its params in the params' shardings), rl.router_replay on (forced_ids),
rl.noreplay_metrics False, rl.micro_batch_rows 0 (one micro-batch), rl.ppo_clip on with
clip_eps 0.2 (Tunix's epsilon).

Figures. memory_analysis() of the `full` compile gives peak HBM per chip. cost_analysis() gives
flops, bytes accessed and optimal_seconds; XLA counts a loop body once, so c2jax's whole-step cost
comes from its unrolled L2 / L4 compiles: per_layer = (f_L4 - f_L2) / 2, whole = f_L2 + (48 - 2) *
per_layer; Tunix's `full` compile is straight-line code, so its cost is read directly (and the same
extrapolation from its L2 / L4 compiles is reported beside it as a check). Mosaic kernels:
`tpu_custom_call` sites per kernel name in the lowered text, and those whose pallas_call carries no
cost_estimate (XLA counts no FLOPs for them; `optimal_seconds + uncounted` adds their useful FLOPs
at the chip's peak: causal flash attention forward, rematerialized forward and backward).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "experiments", "results", "tunix")
GiB = 1024 ** 3
PEAK_BF16 = {"v5p": 459e12, "v4": 275e12, "v5e": 197e12, "v6e": 918e12}

# the point both sides compile
POINT = {"name": "qwen3_30b_a3b-v5p128-fsdp64", "topology": "v5p:4x4x4", "batch": 64, "seq": 4096,
         "prompt_len": 1024, "layers": 48}
# c2jax's layout: tpu_aot.py's point of that name (--c2jax-point picks another, e.g. Tunix's own layout
# qwen3_30b_a3b-ep64-ragged: dense weights FSDP and experts EP over the same 64 chips, dropless)
C2JAX_POINT = "qwen3_30b_a3b-fsdp64"
# Qwen3-30B-A3B's shape (both sides' configs carry the same numbers)
QWEN3_30B = {"heads": 32, "head_dim": 128, "kv_heads": 4, "hidden": 2048, "moe_ffn": 768, "experts": 128,
             "topk": 8, "vocab": 151936}

# the AOT readers MaxText's comparison uses (stdlib-only module; runs in any of the venvs), and
# the bench's own modules (tpu_aot: the c2jax configs of its points, the one cost model; it puts ROOT on the path)
sys.path.insert(0, os.path.join(ROOT, "experiments", "reference"))
sys.path.insert(0, os.path.join(ROOT, "experiments", "bench"))
from maxtext_aot_driver import (cost, kernels_without_cost_estimate, memory, mosaic_calls,  # noqa: E402
                                mosaic_kernels, version)


# ----------------------------------------------------------------------------- shared helpers

def compile_lowered(lowered, topology: str | None = None) -> dict:
    """Compile; the compiler's memory and cost reports, or the exception (an HBM refusal is
    status hbm_oom with the temp the compiler asked for). With `topology`, also the Mosaic calls
    of the optimized HLO and the compile's figures under the one cost model."""
    t0 = time.time()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001  (recorded verbatim)
        msg = f"{type(e).__name__}: {e}"
        out = {"status": "hbm_oom" if ("RESOURCE_EXHAUSTED" in msg or "Ran out of memory" in msg) else "compile_error",
               "error": msg[:4000], "compile_s": round(time.time() - t0, 1)}
        return out
    out = {"status": "ok", "compile_s": round(time.time() - t0, 1), "memory": memory(compiled), "cost": cost(compiled)}
    if topology:
        out["mosaic_calls"] = mosaic_calls(compiled.as_text())
        out["one_model"] = one_model(out, topology)
    del compiled
    return out


def one_model(comp: dict, topology: str) -> dict | None:
    """experiments/bench/tpu_aot.py's one cost model of a compile (the compiler's optimal_seconds
    with every Mosaic call's self-reported cost, both sides' and splash's, replaced by one analytic
    roofline per kernel family from the call's operand shapes and blocks): computed here, in the
    side's own venv, so that --table needs no jax."""
    from tpu_aot import one_model_figures
    return one_model_figures(comp, topology.split(":")[0])


def attention_flops_per_layer(batch: int, seq: int, chips: int, heads: int, head_dim: int) -> float:
    """Useful FLOPs per chip of causal flash attention in one full-remat step, one layer: forward
    2 x rows x H x L^2 x (d_qk + d_v) / 2, run twice (forward and rematerialized forward), backward
    (3 d_qk + 2 d_v) / (d_qk + d_v) x forward (experiments/bench/tpu_aot.py kernel_flops)."""
    dqk = dv = head_dim
    fwd = 2 * (batch / chips) * heads * seq ** 2 * (dqk + dv) / 2
    return 2 * fwd + fwd * (3 * dqk + 2 * dv) / (dqk + dv)


def finish(res: dict, out_dir: str, stem: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True, default=str)
    print(f"wrote {os.path.relpath(path, ROOT)}", flush=True)
    return path


def topology_devices(topology: str):
    from jax.experimental import topologies
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


# ----------------------------------------------------------------------------- Tunix side

class _DevicesAs:
    """A stand-in for the `jax` module inside tunix.models.qwen3.model whose devices() are the
    topology's (every other attribute is jax's)."""

    def __init__(self, jax_module, devices):
        self._jax, self._devices = jax_module, list(devices)

    def devices(self, *a, **k):
        return self._devices

    def __getattr__(self, name):
        return getattr(self._jax, name)


class _ScaledEstimates:
    """A stand-in for `pl` inside jax's megablox gmm module whose CostEstimate scales flops and
    bytes by `factor` (every other attribute is pallas')."""

    def __init__(self, pl_module, factor: float):
        self._pl, self._factor = pl_module, factor

    def CostEstimate(self, flops, bytes_accessed, transcendentals=0, **kw):  # noqa: N802 (pallas' name)
        f = self._factor
        return self._pl.CostEstimate(flops=int(flops * f), bytes_accessed=int(bytes_accessed * f),
                                     transcendentals=transcendentals, **kw)

    def __getattr__(self, name):
        return getattr(self._pl, name)


def gmm_mean_rows_factor(chips: int) -> float:
    """Mean received rows / receive-buffer rows of Tunix's MoE on a (chips, 1) fsdp mesh: each chip
    gets B_local x T x K token copies on average, its megablox buffer holds
    min(K, E / chips) x B_local x T x chips rows (tunix.models.qwen3.model.MoELayer)."""
    k, e = QWEN3_30B["topk"], QWEN3_30B["experts"]
    return k / (min(k, e // chips) * chips)


def tunix_compile(p: dict, layers: int, devices, args) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import algo_core
    from tunix.rl import common as rl_common
    from tunix.rl.grpo import grpo_learner
    from tunix.sft import peft_trainer

    chips = len(devices)
    if not args.tunix_cpu_path:
        qwen3.jax = _DevicesAs(jax, devices)   # Tunix's TPU path (megablox, sharding constraints)
    if args.gmm_estimate_at_mean_rows:
        # the program is unchanged; only the cost estimate megablox hands XLA (2 m k n at the static
        # row count m of the receive buffer) is read at the mean rows a chip receives
        from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
        if not isinstance(megablox_gmm.pl, _ScaledEstimates):
            megablox_gmm.pl = _ScaledEstimates(megablox_gmm.pl, gmm_mean_rows_factor(chips))
    mesh = Mesh(mesh_utils.create_device_mesh((chips, 1), devices), ("fsdp", "tp"))
    cfg = qwen3.ModelConfig.qwen3_30b_a3b()
    cfg = dataclasses.replace(cfg, num_layers=layers, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                              remat_config=qwen3.RematConfig.DECODER,
                              use_flash_attention=not args.tunix_no_flash)
    algo = grpo_learner.GRPOConfig(num_generations=2)   # defaults: beta 0.04, kl 'kl', epsilon 0.2
    algo.temperature = 1.0                              # GRPOLearner copies the rollout's temperature
    pad_id, eos_id = 0, 1
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6, b1=0.9, b2=0.95, weight_decay=0.1))

    t0 = time.time()
    with jax.set_mesh(mesh):   # as tunix.models.safetensors_loader builds the abstract model
        def build():
            model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(params=0))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
        abs_model, abs_opt = nnx.eval_shape(build)
        graphdef, abs_state = nnx.split((abs_model, abs_opt))
        state_sh = nnx.get_named_sharding(abs_state, mesh)
    state_sds = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abs_state, state_sh)
    pure_sh = jax.tree.map(lambda x: x.sharding, state_sds)

    B, L, Pl = p["batch"], p["seq"], p["prompt_len"]
    C = L - Pl
    d_sh = NamedSharding(mesh, P("fsdp"))             # TrainingConfig.data_sharding_axis ('fsdp',)
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=d_sh)  # noqa: E731
    example = grpo_learner.TrainExample(
        prompt_ids=sds((B, Pl), jnp.int32), prompt_mask=sds((B, Pl), jnp.bool_),
        completion_ids=sds((B, C), jnp.int32), completion_mask=sds((B, C), jnp.bool_),
        ref_per_token_logps=sds((B, C), jnp.float32), advantages=sds((B,), jnp.float32),
        old_per_token_logps=sds((B, C), jnp.float32))

    # GRPOLearner.__init__'s loss closure and RL Trainer (PeftTrainer) state, without a cluster
    policy_loss_fn = algo_core.grpo_loss_fn
    trainer = peft_trainer.PeftTrainer.__new__(peft_trainer.PeftTrainer)
    trainer.loss_fn = lambda model, train_example, algo_config: policy_loss_fn(
        model, train_example, algo_config=algo, pad_id=pad_id, eos_id=eos_id)
    trainer.gen_model_input_fn = lambda x: {"train_example": x, "algo_config": algo}
    trainer._lora_enabled, trainer._has_aux = False, True

    def step(state, ex):
        model, optimizer = nnx.merge(graphdef, state)
        loss, aux, grad_norm = trainer._train_step(model, optimizer, ex)
        return nnx.state((model, optimizer)), (loss, aux, grad_norm)

    jitted = jax.jit(step, in_shardings=(pure_sh, None), out_shardings=(pure_sh, None), donate_argnums=(0,))
    res = {"layers": layers, "scan": False, "mesh": {"fsdp": chips, "tp": 1},
           "state_per_chip_gib": _per_chip(state_sds) / GiB}   # params + AdamW moments (+ counters)
    with jax.set_mesh(mesh), mesh:   # RLCluster enters the role's mesh (`with mesh:`); Tunix reads it
        lowered = jitted.lower(state_sds, example)
    res["lower_s"] = round(time.time() - t0, 1)
    text = lowered.as_text()
    res["mosaic_kernels"] = mosaic_kernels(text)
    res["kernels_without_cost_estimate"] = kernels_without_cost_estimate(text)
    res["ragged_all_to_all_sites"] = text.count("ragged_all_to_all")
    del text
    res.update(compile_lowered(lowered, p["topology"]))
    del lowered
    if args.ref_forward and res["status"] == "ok":
        # RLCluster.get_ref_per_token_logps -> common.compute_per_token_logps on the reference model
        t0 = time.time()
        graphdef_m, m_state = nnx.split(abs_model)
        ref_fn = jax.jit(lambda st, pr, co: rl_common.compute_per_token_logps(
            graphdef_m, st, pr, co, pad_id=pad_id, eos_id=eos_id, stop_gradient=True))
        m_sds = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), m_state,
                             nnx.get_named_sharding(m_state, mesh))
        with jax.set_mesh(mesh), mesh:
            lw = ref_fn.lower(m_sds, example.prompt_ids, example.completion_ids)
        text = lw.as_text()
        ref = {"lower_s": round(time.time() - t0, 1), "mosaic_kernels": mosaic_kernels(text),
               "kernels_without_cost_estimate": kernels_without_cost_estimate(text)}
        del text
        ref.update(compile_lowered(lw, p["topology"]))
        res["ref_forward"] = ref
    gc.collect()
    return res


def _per_chip(tree) -> int:
    import jax
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def tunix_side(p: dict, compiles: list, args) -> dict:
    import jax
    devices = topology_devices(p["topology"])
    res = {"side": "tunix", "google-tunix": version("google-tunix"), "jax": jax.__version__,
           "jaxlib": version("jaxlib"), "libtpu": version("libtpu"), "flax": version("flax"),
           "optax": version("optax"), "tpu_path": not args.tunix_cpu_path, "flash": not args.tunix_no_flash,
           "gmm_estimate_scale": gmm_mean_rows_factor(len(devices)) if args.gmm_estimate_at_mean_rows else 1.0,
           "compiles": {}}
    for key in compiles:
        layers = p["layers"] if key == "full" else int(key[1:])
        print(f"[tunix] compiling {key} ({layers} layers) ...", flush=True)
        try:
            r = tunix_compile(p, layers, devices, args)
        except Exception as e:  # noqa: BLE001  (recorded verbatim: where in Tunix it fails)
            r = {"layers": layers, "status": "lower_error", "error": f"{type(e).__name__}: {e}"[:4000],
                 "traceback": traceback.format_exc()[-6000:]}
        res["compiles"][key] = r
        print(f"[tunix] {key}: {r['status']} lower {r.get('lower_s')} s compile {r.get('compile_s')} s "
              f"memory {r.get('memory')} cost {r.get('cost')} kernels {r.get('mosaic_kernels')} "
              f"{r.get('error', '')[:2000]}", flush=True)
    return res


# ----------------------------------------------------------------------------- c2jax side

def c2jax_cfg(p: dict, layers: int | None, unrolled: bool):
    from tpu_aot import c2jax_config, point_spec
    from c2jax.rl.learner import learner_cfg
    cfg = c2jax_config(point_spec(p.get("c2jax_point", C2JAX_POINT)), layers, unrolled)
    cfg.train.batch_size, cfg.train.seq_len = p["batch"], p["seq"]
    r = cfg.rl
    r.kl_coef, r.router_replay, r.noreplay_metrics, r.micro_batch_rows = 1e-3, True, False, 0
    r.ppo_clip, r.clip_eps_low, r.clip_eps_high = True, 0.2, 0.2   # as Tunix's GRPO loss (epsilon 0.2)
    return learner_cfg(cfg)


def c2jax_compile(p: dict, layers: int | None, unrolled: bool, devices) -> dict:
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import validate
    from c2jax.models import flops_per_token
    from c2jax.ops.registry import record_choices
    from c2jax.train.step import train_flops_per_token
    from c2jax.tools import compile_check as cc
    from c2jax.parallel.mesh import make_mesh
    cfg = c2jax_cfg(p, layers, unrolled)
    validate(cfg, num_devices=len(devices))
    mesh = make_mesh(cfg, devices)
    t0 = time.time()
    abstract = cc.abstract_train_state(cfg, mesh)
    with record_choices() as kernels:
        lowered, batch, ref = cc.compile_rl_step(cfg, mesh, abstract)
    res = {"layers": cfg.model.num_layers, "scan": not unrolled, "lower_s": round(time.time() - t0, 1),
           "mesh": {k: int(v) for k, v in mesh.shape.items() if v > 1},
           "ops": {op: dict(v) for op, v in kernels.items()},
           "no_grad_forwards": cc.rl_no_grad_forwards(cfg)}
    text = lowered.as_text()
    res["mosaic_kernels"] = mosaic_kernels(text)
    res["kernels_without_cost_estimate"] = kernels_without_cost_estimate(text)
    del text
    # a scanned program's calls count once per loop body: only the unrolled ones give whole costs
    res.update(compile_lowered(lowered, p["topology"] if unrolled else None))
    res["state"] = cc.state_breakdown(abstract[2])
    res["state"]["reference_gib"] = _per_chip(ref) / GiB if ref is not None else 0.0
    res["state"]["batch_gib"] = _per_chip(batch) / GiB
    tokens = p["batch"] * p["seq"]
    res["model_flops"] = {"train_per_step": train_flops_per_token(cfg, p["seq"]) * tokens,
                          "forward_per_step": flops_per_token(cfg, p["seq"], training=False) * tokens}
    del lowered, abstract, batch, ref
    gc.collect()
    return res


def c2jax_side(p: dict, compiles: list, args) -> dict:
    import jax
    devices = topology_devices(p["topology"])
    res = {"side": "c2jax", "jax": jax.__version__, "jaxlib": version("jaxlib"), "libtpu": version("libtpu"),
           "flax": version("flax"), "optax": version("optax"), "compiles": {}}
    for key in compiles:
        layers, unrolled = (None, False) if key == "full" else (int(key[1:]), True)
        print(f"[c2jax] compiling {key} ...", flush=True)
        try:
            r = c2jax_compile(p, layers, unrolled, devices)
        except Exception as e:  # noqa: BLE001
            r = {"layers": layers, "status": "lower_error", "error": f"{type(e).__name__}: {e}"[:4000],
                 "traceback": traceback.format_exc()[-6000:]}
        res["compiles"][key] = r
        print(f"[c2jax] {key}: {r['status']} lower {r.get('lower_s')} s compile {r.get('compile_s')} s "
              f"memory {r.get('memory')} cost {r.get('cost')} kernels {r.get('mosaic_kernels')} "
              f"{r.get('error', '')[:2000]}", flush=True)
    return res


# ----------------------------------------------------------------------------- figures (no jax)

def extrapolate(lo: dict, hi: dict, n_lo: int, n_hi: int, n_full: int) -> tuple[dict, dict]:
    per, whole = {}, {}
    for k in lo:
        if isinstance(lo[k], (int, float)) and isinstance(hi.get(k), (int, float)):
            per[k] = (hi[k] - lo[k]) / (n_hi - n_lo)
            whole[k] = lo[k] + (n_full - n_lo) * per[k]
    return per, whole


def kernel_family(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "splash", "mha", "_fwd_kernel", "_dq_kernel", "_dkv_kernel")):
        return "attention"
    if "gmm" in n or n in ("_lambda_", "kernel"):   # jax's megablox gmm / tgmm lower as "kernel"
        return "experts"
    return "other"


def summarize(res: dict) -> dict:
    """Whole-step figures of one side's report: peak HBM (full compile), cost (direct from an
    unrolled full compile, else extrapolated from the two smallest unrolled L<n> compiles), the
    uncounted-kernel correction at peak."""
    p = res["point"]
    chips = math.prod(int(x) for x in p["topology"].split(":")[1].split("x"))
    peak = PEAK_BF16[p["topology"].split(":")[0]]
    c = res.get("compiles", {})
    s = {"side": res["side"]}
    full = c.get("full", {})
    if full.get("status") == "ok":
        s["peak_hbm_gib"] = full["memory"]["peak_gib"]
        s["hbm"] = {k: full["memory"][k] for k in ("arguments_gib", "temp_gib", "outputs_gib", "aliased_gib")}
        s["hbm_source"] = f"full depth ({p['layers']} layers)"
    elif full:
        s["full_status"] = full.get("status")
        s["full_error"] = full.get("error", "")
    lows = sorted((int(k[1:]), k) for k, v in c.items() if k.startswith("L") and v.get("status") == "ok")
    if len(lows) >= 2:
        (n_lo, k_lo), (n_hi, k_hi) = lows[0], lows[1]
        s["per_layer"], s["extrapolated"] = extrapolate(c[k_lo]["cost"], c[k_hi]["cost"], n_lo, n_hi, p["layers"])
        s["extrapolated_from"] = [k_lo, k_hi]
        if "peak_hbm_gib" not in s:
            _, mem = extrapolate(c[k_lo]["memory"], c[k_hi]["memory"], n_lo, n_hi, p["layers"])
            s["peak_hbm_gib"] = mem["peak_gib"]
            s["hbm"] = {k: mem[k] for k in ("arguments_gib", "temp_gib", "outputs_gib", "aliased_gib")}
            s["hbm_source"] = f"extrapolated linearly from the unrolled {k_lo} and {k_hi}" + (
                f" (full compile: {s['full_status']})" if "full_status" in s else "")
    def whole(get, tree=c, top=full):   # the whole step's figure `get` of one program of the side
        return _whole_figures(top, tree, lows, p["layers"], get, not full.get("scan", True))

    refs, ref_full = {k: v.get("ref_forward", {}) for k, v in c.items()}, full.get("ref_forward", {})
    w, src = whole(_reported("cost"))
    if w:
        s["whole"], s["whole_source"] = w, src
    rw, rsrc = whole(_reported("cost"), refs, ref_full)
    rm, _ = whole(_reported("memory"), refs, ref_full)
    if rw and rm:
        s["ref_forward"] = {"peak_hbm_gib": rm["peak_gib"], **rw, "source": rsrc}
    s["one_model"] = one_model_summary(res["side"], whole(_reported("one_model")),
                                       whole(_reported("one_model"), refs, ref_full))
    kernels_src = full if full.get("mosaic_kernels") is not None else (c[lows[-1][1]] if lows else {})
    s["mosaic_kernels"] = kernels_src.get("mosaic_kernels", {})
    s["kernels_without_cost_estimate"] = kernels_src.get("kernels_without_cost_estimate", {})
    fams = sorted({kernel_family(k) for k in s["kernels_without_cost_estimate"]} - {"other"})
    s["uncounted_families"] = fams
    if "whole" in s:
        extra = 0.0
        if "attention" in fams:
            extra += attention_flops_per_layer(p["batch"], p["seq"], chips, QWEN3_30B["heads"],
                                               QWEN3_30B["head_dim"]) * p["layers"]
        if "experts" in fams:
            extra += 4 * 2 * p["batch"] * p["seq"] / chips * QWEN3_30B["topk"] * 3 * QWEN3_30B["hidden"] \
                * QWEN3_30B["moe_ffn"] * p["layers"]
        s["uncounted_flops_per_chip"] = extra
        s["optimal_seconds_plus_uncounted"] = s["whole"]["optimal_seconds"] + extra / peak
    return s


def _reported(key: str):
    """A compile's figure `key` (cost, memory, one_model), None where it did not compile."""
    return lambda r: r.get(key) if r.get("status") == "ok" else None


def _whole_figures(full: dict, c: dict, lows: list, layers: int, get, full_unrolled: bool) -> tuple[dict | None, str]:
    """get(compile) of the whole step: read from an unrolled full-depth compile (XLA counts every
    layer), else extrapolated from the two smallest unrolled L<n> compiles; (None, why) when
    neither has it."""
    if get(full) and full_unrolled:
        return get(full), "full-depth compile"
    have = [(n, k) for n, k in lows if get(c.get(k, {}))]
    if len(have) >= 2:
        (n_lo, k_lo), (n_hi, k_hi) = have[0], have[1]
        return extrapolate(get(c[k_lo]), get(c[k_hi]), n_lo, n_hi, layers)[1], f"extrapolated from {k_lo} and {k_hi}"
    return None, "no compile reports it"


def one_model_summary(side: str, update: tuple, ref_forward: tuple) -> dict:
    """The whole step under the one cost model from (figures, source) of the update program and of
    the reference model's forward where the side runs it as a program of its own (Tunix); c2jax's
    step holds the reference forward (rl.kl_coef > 0)."""
    upd, src = update
    out = {"update": upd, "update_source": src, "reference_in_step": side == "c2jax"}
    out["ref_forward"], out["ref_forward_source"] = (None, "inside the step") if side == "c2jax" else ref_forward
    ref_s = 0.0 if side == "c2jax" else (out["ref_forward"] or {}).get("optimal_seconds")
    out["step_s"] = upd["optimal_seconds"] + ref_s if upd and ref_s is not None else None
    return out


def fmt(x, f="{:.2f}"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f.format(x)


def row_label(r: dict) -> str:
    """A report's row: the side, and c2jax's layout where it is not the default point."""
    point = r.get("point", {}).get("c2jax_point", C2JAX_POINT)
    return r["side"] if r["side"] != "c2jax" or point == C2JAX_POINT else f"c2jax {point}"


def table(paths: list) -> tuple[str, dict]:
    """Markdown table, one row per side and layout (reports of the same row merged, later files'
    compiles winning), and the verdict of each c2jax row against Tunix under the one cost model."""
    latest = {}   # row -> (paths, report with the compiles of all its reports)
    for path in sorted(paths):
        with open(path) as f:
            r = json.load(f)
        key = row_label(r)
        if key in latest:
            prev_paths, prev = latest[key]
            r["compiles"] = {**prev["compiles"], **r["compiles"]}
            path = f"{prev_paths} + {os.path.basename(path)}"
        latest[key] = (path, r)
    lines = ["| side | peak HBM / chip GiB (args, temp, out) | TFLOPs / chip | bytes accessed / chip GB | "
             "optimal_seconds | cost from | kernels without cost estimate | optimal_seconds + their FLOPs at peak | "
             "step, one cost model: update + reference forward s | Mosaic kernels (call sites in the lowered program) "
             "| report |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    sums = {}
    for key in sorted(latest, key=lambda k: (k != "tunix", k)):
        path, r = latest[key]
        s = summarize(r)
        sums[key] = s
        h = s.get("hbm", {})
        hbm = (f"{fmt(s.get('peak_hbm_gib'))} ({fmt(h.get('arguments_gib'))}, {fmt(h.get('temp_gib'))}, "
               f"{fmt(h.get('outputs_gib'))}); {s['hbm_source']}" if "peak_hbm_gib" in s
               else f"{s.get('full_status', 'not compiled')}")
        w = s.get("whole", {})
        om = s["one_model"]
        if om["step_s"] is not None:
            ref = "in the step" if om["reference_in_step"] else f"{om['ref_forward']['optimal_seconds']:.3f}"
            one = (f"{om['step_s']:.3f} = {om['update']['optimal_seconds']:.3f} + {ref} "
                   f"({om['update_source']}; reference: {om['ref_forward_source']})")
        else:
            one = f"n/a ({om['update_source']}; reference: {om['ref_forward_source']})"
        kern = ", ".join(f"{k} x{v}" for k, v in s["mosaic_kernels"].items()) or "none"
        noest = ", ".join(f"{k} x{v}" for k, v in s["kernels_without_cost_estimate"].items()) or "none"
        lines.append(f"| {key} | {hbm} | {fmt(w.get('flops', None) and w['flops'] / 1e12, '{:.1f}')} | "
                     f"{fmt(w.get('bytes_accessed', None) and w['bytes_accessed'] / 1e9, '{:.1f}')} | "
                     f"{fmt(w.get('optimal_seconds'), '{:.3f}')} | {s.get('whole_source', 'n/a')} | {noest} | "
                     f"{fmt(s.get('optimal_seconds_plus_uncounted'), '{:.3f}')} | {one} | {kern} | "
                     f"{path} |")
    lines += [""] + verdict(sums)
    return "\n".join(lines) + "\n", sums


def verdict(sums: dict) -> list[str]:
    """One line per c2jax row: HBM and one-cost-model step against Tunix's, and whether c2jax is
    no slower and uses no more HBM."""
    t = sums.get("tunix")
    out = []
    for key, s in sums.items():
        if key == "tunix" or t is None:
            continue
        hbm_t, hbm_c = t.get("peak_hbm_gib"), s.get("peak_hbm_gib")
        st_t, st_c = t["one_model"]["step_s"], s["one_model"]["step_s"]
        parts = [f"- {key} vs tunix:"]
        if hbm_t and hbm_c:
            parts.append(f"HBM {hbm_c:.2f} vs {hbm_t:.2f} GiB ({hbm_t / hbm_c:.2f}x less: "
                         f"{'met' if hbm_c <= hbm_t else 'not met'});")
        if st_t and st_c:
            parts.append(f"step under the one cost model {st_c:.3f} vs {st_t:.3f} s ({st_t / st_c:.2f}x: "
                         f"{'met' if st_c <= st_t else 'not met'})")
        else:
            parts.append("step under the one cost model: not available for both sides")
        out.append(" ".join(parts))
    return out


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("tunix", "c2jax"))
    ap.add_argument("--compiles", default="L2,L4,full", help="comma list of L<n> (unrolled, n layers) and full")
    ap.add_argument("--batch", type=int, default=POINT["batch"])
    ap.add_argument("--seq", type=int, default=POINT["seq"])
    ap.add_argument("--prompt-len", type=int, default=POINT["prompt_len"],
                    help="Tunix: prompt tokens of each row (completion = seq - prompt)")
    ap.add_argument("--topology", default=POINT["topology"])
    ap.add_argument("--ref-forward", action="store_true",
                    help="Tunix: also compile the reference logps program at each depth")
    ap.add_argument("--tunix-cpu-path", action="store_true",
                    help="Tunix: keep the MoE / sharding path Tunix picks from this host's CPU devices")
    ap.add_argument("--tunix-no-flash", action="store_true", help="Tunix: use_flash_attention False (its default)")
    ap.add_argument("--gmm-estimate-at-mean-rows", action="store_true",
                    help="Tunix: scale megablox's cost estimates to the mean rows a chip receives (same program)")
    ap.add_argument("--c2jax-point", default=C2JAX_POINT,
                    help="c2jax: the layout, a point of experiments/bench/tpu_aot.py (qwen3_30b_a3b-ep64-ragged: "
                         "Tunix's EP 64 over the fsdp chips, dropless)")
    ap.add_argument("--tag", default="", help="suffix of the report's file name")
    ap.add_argument("--out-dir", default=DEFAULT_OUT)
    ap.add_argument("--table", nargs="*", help="print the markdown table of these reports and exit")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(table(args.table)[0])
        return 0
    if not args.side:
        ap.error("--side or --table is required")
    p = dict(POINT, batch=args.batch, seq=args.seq, prompt_len=args.prompt_len, topology=args.topology)
    if args.side == "c2jax":
        p["c2jax_point"] = args.c2jax_point
    compiles = [c.strip() for c in args.compiles.split(",") if c.strip()]
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.time()
    res = (tunix_side if args.side == "tunix" else c2jax_side)(p, compiles, args)
    res.update(point=p, date=started.strftime("%Y-%m-%d %H:%M UTC"), wall_s=round(time.time() - t0, 1),
               command=" ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT)
                                 else sys.executable, os.path.relpath(__file__, ROOT), *sys.argv[1:]]))
    res["summary"] = summarize(res)
    layout = f"-{args.c2jax_point}" if args.side == "c2jax" and args.c2jax_point != C2JAX_POINT else ""
    stem = f"{started:%Y-%m-%d}_{args.side}_{p['name']}{layout}" + (f"-{args.tag}" if args.tag else "")
    finish(res, args.out_dir, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
