"""Side-by-side TPU ahead-of-time compile of c2jax's train step and MaxText's, same model, same
slice, same batch / sequence / precision / remat / mesh, on this CPU machine (libtpu compiles for
a topology from jax.experimental.topologies; nothing runs on a TPU).

    .venv/bin/python experiments/bench/tpu_aot.py --list
    .venv/bin/python experiments/bench/tpu_aot.py --point qwen3_30b_a3b-fsdp64
    .venv/bin/python experiments/bench/tpu_aot.py --point qwen3_30b_a3b-fsdp8_ep8 --side c2jax
    .venv/bin/python experiments/bench/tpu_aot.py --tiny --out-dir /tmp/aot

Each side's step: f32 params + AdamW moments (f32), bf16 compute, full remat of every layer,
global-norm clip 1.0, dropless MoE with the grouped-matmul kernels, flash attention.
  c2jax:   c2jax.train.step.make_train_step through c2jax.tools.compile_check (its abstract
           sharded train state, its lowering on the topology's TPU devices), in this process.
  MaxText: maxtext.trainers.pre_train.train_compile.main in `.venv-maxtext`, as a subprocess
           through experiments/reference/maxtext_aot_driver.py (a point whose venv is missing
           is recorded as "not run: .venv-maxtext missing").

Figures. XLA's cost analysis counts a loop body once, so FLOPs, bytes accessed and the
compiler's optimal_seconds come from two UNROLLED compiles of `lo` and `hi` layers (2 and 4 by
default; more when the model has leading dense layers, so both hold every dense layer):
    per_layer = (f_hi - f_lo) / (hi - lo),   whole = f_lo + (L - lo) * per_layer.
Peak HBM per chip comes from a compile of the full-depth model with its layers scanned (the way
both train; `hbm_source` says so), unless --no-full, when it is extrapolated the same way from
the unrolled compiles (`hbm_source` says that too). Model FLOPs = 6 * N_active * tokens +
causal attention FLOPs (c2jax.models.flops_per_token, the same figure for both sides); implied
MFU = model FLOPs per chip / (whole optimal_seconds * the chip's peak bf16 FLOP/s). Kernels:
`tpu_custom_call` sites per Mosaic kernel name in each lowered program, and those whose
pallas_call sets no cost_estimate: XLA counts no FLOPs for them, so `optimal_seconds_plus_uncounted`
adds their useful FLOPs (kernel_flops) at the chip's peak.

    .venv/bin/python experiments/bench/tpu_aot.py --resummarize OUT_DIR/*.json   # refigure, no compiling
    .venv/bin/python experiments/bench/tpu_aot.py --table OUT_DIR/*.json         # one row per point and side

Outputs: OUT_DIR/DATE_POINT.json and OUT_DIR/DATE_POINT.md (one table per run).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
MAXTEXT_PY = os.path.join(ROOT, ".venv-maxtext", "bin", "python")
DRIVER = os.path.join(ROOT, "experiments", "reference", "maxtext_aot_driver.py")
DEFAULT_OUT = os.path.join(ROOT, "experiments", "results", "tpu_aot")
GiB = 1024 ** 3
sys.path.insert(0, os.path.dirname(DRIVER))
from maxtext_aot_driver import cost as _cost, kernels_without_cost_estimate, mosaic_calls  # noqa: E402  (no MaxText import)
from pallas_kernels.cost import roofline_seconds  # noqa: E402

# ----------------------------------------------------------------------------- points
# model: c2jax config file (plus model overrides) and MaxText's model_name (plus overrides)
MODELS = {
    "qwen3_30b_a3b": {"c2jax": "configs/qwen3_moe_30b_a3b.py", "maxtext": "qwen3-30b-a3b", "c2jax_model": {},
                      "maxtext_model": {}},
    "deepseek_v3_671b": {"c2jax": "configs/deepseek_v3_671b.py", "maxtext": "deepseek3-671b",
                         # MaxText's deepseek3-671b has no MTP head and routes without groups
                         # unless n_routing_groups / topk_routing_group are set: set them as V3 does
                         "c2jax_model": {"num_mtp_layers": 0},
                         "maxtext_model": {"n_routing_groups": 8, "topk_routing_group": 4}},
    "kimi_k2_1t": {"c2jax": "configs/kimi_k2_1t.py", "maxtext": "kimi-k2-1t", "c2jax_model": {"num_mtp_layers": 0},
                   "maxtext_model": {}},
    # a Qwen3-MoE-shaped toy (the test's point): c2jax defaults, bf16, 4 layers
    "tiny": {"c2jax": None, "maxtext": "qwen3-30b-a3b",
             "c2jax_model": {"name": "tiny", "dtype": "bfloat16", "num_layers": 4, "first_k_dense": 0,
                             "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 128,
                             "moe_intermediate_size": 128, "intermediate_size": 256, "num_experts": 8,
                             "num_experts_per_tok": 2, "vocab_size": 512},
             "maxtext_model": {"base_emb_dim": 128, "base_num_query_heads": 4, "base_num_kv_heads": 2,
                               "head_dim": 128, "base_moe_mlp_dim": 128, "base_mlp_dim": 128, "num_experts": 8,
                               "num_experts_per_tok": 2, "vocab_size": 512}},
}

# remat policies each side documents (c2jax: c2jax.config.REMAT_POLICIES; MaxText 0.2.5's base.yml
# remat_policy, "fastest to slowest", without the host-offloading ones and `custom`); "full" on both
# sides unless --c2jax-remat / --maxtext-remat say otherwise
MAXTEXT_REMAT = ("minimal_with_context", "minimal", "save_dot_with_context_except_mlp", "save_dot_except_mlpwi",
                 "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "full", "custom_all_device")
# "custom_all_device": base.yml's `custom` policy with every tensor it names kept on device (its
# closest option to keeping all activations, c2jax's `none`)
MAXTEXT_CUSTOM_TENSORS = ("context", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo",
                          "moe_x_sorted", "moe_routing_maps", "query_proj", "key_proj", "value_proj", "kv_proj",
                          "qkv_proj", "out_proj", "query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "attention_out")
HBM_FIT = 0.9   # a best-vs-best candidate fits when its peak HBM per chip is at most this share of the chip's

C2JAX_EP_CAPACITY = 2.0   # c2jax's mesh.ep_capacity_factor at every EP point unless the point sets one

# layout: (c2jax mesh.shape over (data, fsdp, context, expert), c2jax rules, MaxText ici_* settings)
FSDP_RULES = {"embed": "fsdp", "expert_fsdp": "fsdp", "experts": "expert", "batch": ("data", "fsdp", "expert")}
EP_RULES = {"embed": ("fsdp", "expert"), "expert_embed": "fsdp", "experts": "expert",
            "batch": ("data", "fsdp", "expert")}


def layout(fsdp: int, ep: int, cp: int = 1) -> dict:
    """c2jax mesh + rules and MaxText's ici settings of an FSDP x CP x EP layout. Under CP both
    shard the sequence over `context` and use it as one more FSDP axis for the weights (MaxText's
    embed / embed_no_exp rules list context)."""
    rules = dict(FSDP_RULES if ep == 1 else EP_RULES)
    if cp > 1:
        rules["embed"] = ("fsdp", "context") + (("expert",) if ep > 1 else ())
        rules["expert_embed"] = ("fsdp", "context")
        rules["length"] = "context"
    mt = {"ici_fsdp_parallelism": fsdp, "ici_expert_parallelism": ep}
    if cp > 1:
        mt["ici_context_parallelism"] = cp
    return {"c2jax_mesh": (1, fsdp, cp, ep), "c2jax_rules": rules, "maxtext_mesh": mt}


POINTS = {
    "qwen3_30b_a3b-fsdp64": dict(model="qwen3_30b_a3b", topology="v5p:4x4x4", fsdp=64, ep=1, batch=64, seq=4096),
    # the same, with c2jax's option of the output head + loss in 8 rematerialized sequence chunks
    "qwen3_30b_a3b-fsdp64-head_chunks8": dict(model="qwen3_30b_a3b", topology="v5p:4x4x4", fsdp=64, ep=1, batch=64,
                                              seq=4096, c2jax_extra={"head_chunks": 8}),
    "qwen3_30b_a3b-fsdp8_ep8": dict(model="qwen3_30b_a3b", topology="v5p:4x4x4", fsdp=8, ep=8, batch=64, seq=4096),
    # the same with c2jax's ragged EP exchange: dropless like MaxText's (receive buffers for the worst
    # case), and with receive buffers of 2x the local assignments (drops only past a receiver's 2x)
    "qwen3_30b_a3b-fsdp8_ep8-ragged": dict(model="qwen3_30b_a3b", topology="v5p:4x4x4", fsdp=8, ep=8, batch=64,
                                           seq=4096, c2jax_mesh_extra={"ep_exchange": "ragged",
                                                                       "ep_capacity_factor": 0.0}),
    "qwen3_30b_a3b-fsdp8_ep8-ragged2": dict(model="qwen3_30b_a3b", topology="v5p:4x4x4", fsdp=8, ep=8, batch=64,
                                            seq=4096, c2jax_mesh_extra={"ep_exchange": "ragged"}),
    # Tunix's default layout for this slice (tunix_rl_aot.py): dense weights FSDP and experts EP over the
    # same 64 chips (2 experts a chip), a ragged all-to-all into dropless worst-case receive buffers
    "qwen3_30b_a3b-ep64-ragged": dict(model="qwen3_30b_a3b", topology="v5p:4x4x4", fsdp=1, ep=64, batch=64, seq=4096,
                                      c2jax_mesh_extra={"ep_exchange": "ragged", "ep_capacity_factor": 0.0}),
    # v5p-512 (256 chips): 671B x 16 B of f32 state + grads = 10.7 TB, 42 GB per chip
    "deepseek_v3_671b-fsdp32_ep8": dict(model="deepseek_v3_671b", topology="v5p:4x8x8", fsdp=32, ep=8, batch=256,
                                        seq=4096, layers=(4, 6)),
    # v5p-1024 (512 chips): 1.04T x 16 B = 16.6 TB, 32 GB per chip
    "kimi_k2_1t-fsdp64_ep8": dict(model="kimi_k2_1t", topology="v5p:8x8x8", fsdp=64, ep=8, batch=512, seq=4096),
    # long rows with context parallelism, as the pod configs train (32 x 32K tokens per step, CP 2,
    # EP 8); on MaxText's axes: fsdp 4 x context 2 x expert 8
    "qwen3_30b_a3b-fsdp4_cp2_ep8": dict(model="qwen3_30b_a3b", topology="v5p:4x4x4", fsdp=4, ep=8, cp=2, batch=32,
                                        seq=32768),
    # Kimi K2 in the report's layouts (EP x CP, 2M tokens per step, 4096 tokens per chip as above):
    # CPT, CP 2 over 8K rows; RL, CP 8 over 32K rows. EP 8 on both sides (MaxText's EP is one mesh
    # axis; the pod config's EP 64 over data x context x expert has no MaxText equivalent)
    "kimi_k2_1t-fsdp32_cp2_ep8": dict(model="kimi_k2_1t", topology="v5p:8x8x8", fsdp=32, ep=8, cp=2, batch=256,
                                      seq=8192),
    "kimi_k2_1t-fsdp8_cp8_ep8": dict(model="kimi_k2_1t", topology="v5p:8x8x8", fsdp=8, ep=8, cp=8, batch=64,
                                     seq=32768),
    # DeepSeek-V3 in the CPT layout (CP 2 over 8K rows, EP 8; 4096 tokens per chip as above)
    "deepseek_v3_671b-fsdp16_cp2_ep8": dict(model="deepseek_v3_671b", topology="v5p:4x8x8", fsdp=16, ep=8, cp=2,
                                            batch=128, seq=8192, layers=(4, 6)),
    # ... and in the RL layout (CP 8 over 32K rows)
    "deepseek_v3_671b-fsdp4_cp8_ep8": dict(model="deepseek_v3_671b", topology="v5p:4x8x8", fsdp=4, ep=8, cp=8,
                                           batch=32, seq=32768, layers=(4, 6)),
    "tiny": dict(model="tiny", topology="v5p:2x2x1", fsdp=2, ep=2, batch=8, seq=256),
}

# what differs between the two programs of a point, whatever the layout
COMMON_DIFFERENCES = [
    "MoE dispatch: c2jax sorts token copies by expert and runs the Pallas grouped matmul (gmm/tgmm) on "
    "each chip's tokens; MaxText (sparse_matmul + megablox) does the same with its megablox kernels. With "
    "EP, c2jax exchanges fixed-size rows per peer (mesh.ep_capacity_factor: rows past that factor x the mean "
    "load per peer are dropped) unless a point sets mesh.ep_exchange 'ragged' (the -ragged points: only the "
    "routed rows sent, receive buffers of that factor x the local assignments, 0 = worst case, dropless); "
    "MaxText a ragged all-to-all with receive buffers of ragged_buffer_factor x the balanced load, set to "
    "c2jax's factor (-1, its worst case and dropless, where c2jax's is 0).",
    "Attention: c2jax's own Pallas flash kernels (pallas_kernels/flash_attention: forward, dK/dV, dQ); "
    "MaxText's splash attention (jax's, attention=flash).",
    "Kernel costs: XLA counts a Mosaic call only by the estimate its author hands it (c2jax's kernels "
    "and megablox set one, splash none). The 'one cost model' figures replace every Mosaic call's "
    "self-reported cost, on both sides, by pallas_kernels/cost.py's model of it from the call's operand "
    "shapes and the blocks its kernel body uses (grouped matmuls: lhs once per n-tile, rhs once or per "
    "row-tile visit when K is tiled, out once; attention: q / o once, k / v re-read once per query block "
    "over the causal blocks; FLOPs: grouped matmuls' whole tiles per row-tile visit, tiles_m + G - 1 visits, "
    "so a tile straddling experts is multiplied once per expert in it; attention's causal pairs), timed by "
    "XLA's own roofline "
    "(max(FLOPs / 394 TFLOP/s, bytes / 2.35 TB/s) on v5p, measured by --xla-roofline). optimal_seconds "
    "is the compiler's figure with each side's self-reported kernel costs.",
    "Loss: c2jax's token NLL op and z-loss 0; MaxText's cross entropy (z-loss 0). Both clip the global "
    "gradient norm at 1.0 and run AdamW (b1 0.9, b2 0.95, wd 0.1).",
    "Device order: the same TPU devices (get_topology_desc of the same topology name, MaxText with "
    "internal_compile=true); c2jax builds its mesh with mesh_utils.create_device_mesh, MaxText with its "
    "create_device_mesh (allow_split_physical_axes=true), which may place the axes on the torus differently.",
]


def chips_of(topology: str) -> int:
    """Chips in a "<chip>:AxBxC" topology."""
    return math.prod(int(x) for x in topology.split(":")[1].split("x"))


def point_spec(name: str) -> dict:
    if name not in POINTS:
        raise SystemExit(f"unknown point {name!r}; --list shows them")
    p = dict(POINTS[name])
    p["name"] = name
    p.setdefault("layers", (2, 4))
    p.setdefault("cp", 1)
    p.update(layout(p["fsdp"], p["ep"], p["cp"]))
    p["remat"] = {"c2jax": "full", "maxtext": "full"}
    return p


def with_remat(p: dict, c2jax: str | None = None, maxtext: str | None = None) -> dict:
    """Point p with each side's remat policy (None: keep); a policy neither side documents is an error."""
    from c2jax.config import REMAT_POLICIES
    if c2jax is not None and c2jax not in REMAT_POLICIES:
        raise SystemExit(f"--c2jax-remat {c2jax!r}: one of {REMAT_POLICIES}")
    if maxtext is not None and maxtext not in MAXTEXT_REMAT:
        raise SystemExit(f"--maxtext-remat {maxtext!r}: one of {MAXTEXT_REMAT}")
    p = dict(p)
    p["remat"] = {"c2jax": c2jax or p["remat"]["c2jax"], "maxtext": maxtext or p["remat"]["maxtext"]}
    return p


def remat_suffix(p: dict, sides) -> str:
    """The report stem's suffix naming each compiled side's remat policy other than full."""
    return "".join(f"-{s}_remat_{p['remat'][s]}" for s in sides if p["remat"][s] != "full")


# ----------------------------------------------------------------------------- c2jax side

def c2jax_config(p: dict, layers: int | None, unrolled: bool):
    """The c2jax config of point `p` with `layers` decoder layers (None = the model's), its layer
    stack unrolled (straight-line code) or scanned."""
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import default_config, load_config_file
    spec = MODELS[p["model"]]
    cfg = default_config()
    if spec["c2jax"]:
        cfg.model = load_config_file(os.path.join(ROOT, spec["c2jax"])).model
    for k, v in spec["c2jax_model"].items():
        with cfg.model.ignore_type():
            cfg.model[k] = v
    for k, v in p.get("c2jax_extra", {}).items():
        cfg.model[k] = v
    m = cfg.model
    m.dtype, m.param_dtype, m.remat, m.moe_dispatch = "bfloat16", "float32", p["remat"]["c2jax"], "dropless"
    if layers is not None:
        m.num_layers = layers
    m.scan_unroll = m.num_layers if unrolled else 1
    cfg.mesh.shape = tuple(p["c2jax_mesh"])
    rules = dict(p["c2jax_rules"])
    if m.attention == "mla":
        # MLA's up-projections q_b_proj [q_lora, heads] and kv_b_proj [kv_lora, heads] have no embed
        # dim: shard them (and o_proj) by heads over the embed axes, as configs/pods/kimi_k2_1t.py
        # does; MaxText shards the same weights by their q_lora / kv_lora dim over the same axes
        rules["heads"] = rules["embed"]
    cfg.mesh.rules = tuple((n, rules.get(n, t)) for n, t in cfg.mesh.rules)
    cfg.mesh.ep_capacity_factor = C2JAX_EP_CAPACITY
    for k, v in p.get("c2jax_mesh_extra", {}).items():
        cfg.mesh[k] = v
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.grad_accum = p["batch"], p["seq"], 1
    return cfg


def c2jax_compile(p: dict, layers: int | None, unrolled: bool, devices) -> dict:
    """Lower + compile c2jax's train step for one depth; the compiler's reports."""
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import validate
    from c2jax.ops.registry import record_choices
    from c2jax.tools import compile_check as cc
    from c2jax.parallel.mesh import make_mesh
    cfg = c2jax_config(p, layers, unrolled)
    validate(cfg, num_devices=len(devices))
    mesh = make_mesh(cfg, devices)
    t0 = time.time()
    abstract = cc.abstract_train_state(cfg, mesh)
    with record_choices() as kernels:
        lowered = cc.compile_train_step(cfg, mesh, abstract)
    lower_s = time.time() - t0
    text = lowered.as_text()
    mosaic = cc.mosaic_kernels(text)
    no_estimate = kernels_without_cost_estimate(text)
    del text
    t0 = time.time()
    compiled, oom = cc._compile(lowered)
    compile_s = time.time() - t0
    out = {"layers": cfg.model.num_layers, "scan": not unrolled, "lower_s": round(lower_s, 1),
           "compile_s": round(compile_s, 1), "mesh": {k: int(v) for k, v in mesh.shape.items() if v > 1},
           "ops": {op: dict(v) for op, v in kernels.items()}, "mosaic_kernels": mosaic,
           "kernels_without_cost_estimate": no_estimate}
    if compiled is None:
        out.update(status="hbm_oom", memory=oom, error=oom.get("compile_error"))
    else:
        out.update(status="ok", memory=cc._memory(compiled), cost=_cost(compiled))
        if unrolled:   # the cost extrapolation's compiles: their kernel calls, for the one cost model
            out["mosaic_calls"] = mosaic_calls(compiled.as_text())
        out["memory"].update(cc.state_breakdown(abstract[2]))
    del compiled, lowered, abstract
    gc.collect()
    return out


def c2jax_side(p: dict, compiles: list[tuple[str, int | None, bool]]) -> dict:
    from c2jax.tools import compile_check as cc
    devices = cc.topology_devices(p["topology"])
    res = {"side": "c2jax", "jax": _version("jax"), "libtpu": _version("libtpu"), "compiles": {}}
    for key, layers, unrolled in compiles:
        print(f"[c2jax] {p['name']}: compiling {key} ...", flush=True)
        r = c2jax_compile(p, layers, unrolled, devices)
        res["compiles"][key] = r
        print(f"[c2jax] {key}: {r['status']} lower {r['lower_s']} s, compile {r['compile_s']} s, "
              f"HBM {r['memory'].get('peak_gib', float('nan')):.2f} GiB, cost {r.get('cost')}", flush=True)
    return res


# ----------------------------------------------------------------------------- MaxText side

def maxtext_overrides(p: dict, layers: int | None, unrolled: bool) -> list[str]:
    spec = MODELS[p["model"]]
    chips = chips_of(p["topology"])
    if (p["batch"] * p["cp"]) % chips:
        raise SystemExit(f"{p['name']}: MaxText's per_device_batch_size needs batch x CP ({p['batch']} x {p['cp']}) "
                         f"divisible by {chips}")
    pdbs = p["batch"] // chips if p["batch"] % chips == 0 else p["batch"] / chips   # < 1 under CP
    ov = {"model_name": spec["maxtext"], "override_model_config": "true",
          "compile_topology": p["topology"], "internal_compile": "true", "internal_compile_num_devices": chips,
          "compile_topology_num_slices": 1, "dcn_data_parallelism": 1,
          "per_device_batch_size": pdbs, "max_target_length": p["seq"],
          "remat_policy": "custom" if p["remat"]["maxtext"] == "custom_all_device" else p["remat"]["maxtext"],
          **({t: "device" for t in MAXTEXT_CUSTOM_TENSORS} if p["remat"]["maxtext"] == "custom_all_device" else {}),
          "weight_dtype": "float32", "dtype": "bfloat16",
          "scan_layers": "false" if unrolled else "true", "allow_split_physical_axes": "true",
          "attention": "flash", "sparse_matmul": "true", "megablox": "true", "capacity_factor": -1.0,
          "opt_type": "adamw", "gradient_clipping_threshold": 1.0, "gradient_accumulation_steps": 1,
          "dataset_type": "synthetic", "enable_checkpointing": "false", "run_name": "tpu_aot",
          "base_output_directory": "/tmp/maxtext_aot", "enable_tensorboard": "false",
          **p["maxtext_mesh"], **spec["maxtext_model"]}
    ov.update(maxtext_matching(p))
    ov.update(p.get("maxtext_extra", {}))
    if layers is not None:
        ov["base_num_decoder_layers"] = layers
    return [f"{k}={v}" for k, v in ov.items()]


def c2jax_capacity(p: dict) -> float:
    """c2jax's EP receive-buffer factor at point p (0 = worst-case buffers, dropless)."""
    return float(p.get("c2jax_mesh_extra", {}).get("ep_capacity_factor", C2JAX_EP_CAPACITY))


def maxtext_matching(p: dict) -> dict:
    """MaxText's settings that match c2jax's at point p: the expert weights' FSDP split over their
    expert dim where c2jax splits experts over fsdp (shard_exp_on_fsdp), EP receive buffers of the
    same factor of the balanced load as c2jax's capacity (ragged_buffer_factor; -1 = MaxText's
    worst case, dropless, where c2jax's is 0), and the output head in the same number of chunks
    (num_vocab_tiling)."""
    if "maxtext_matching" in p:   # a written report's, as recorded
        return dict(p["maxtext_matching"])
    ov = {}
    if p["ep"] == 1 and p["c2jax_rules"].get("expert_fsdp") == "fsdp":
        ov["shard_exp_on_fsdp"] = "true"
    if p["ep"] > 1:
        cap = c2jax_capacity(p)
        ov["ragged_buffer_factor"] = cap if cap > 0 else -1.0
    chunks = p.get("c2jax_extra", {}).get("head_chunks", 1)
    if chunks > 1:
        ov["num_vocab_tiling"] = chunks
    if p.get("maxtext_tiles", "default") == "chosen":
        ov.update(maxtext_gmm_tiles(p))
    return ov


def maxtext_gmm_rows(p: dict) -> tuple[int, int]:
    """(rows, groups) of MaxText's megablox calls at point p: each chip's token copies (tokens x
    top-k; under EP its receive buffer, ragged_buffer_factor x that, or the worst case
    EP x tokens x min(top-k, local experts)) over its local experts."""
    m = c2jax_config(p, None, False).model
    tokens = p["batch"] * p["seq"] // chips_of(p["topology"])
    groups = m.num_experts // p["ep"]
    rows = tokens * m.num_experts_per_tok
    if p["ep"] > 1:
        cap = c2jax_capacity(p)
        rows = int(cap * rows) if cap > 0 else p["ep"] * tokens * min(m.num_experts_per_tok, groups)
    return rows, groups


# the TPU compiler's default scoped VMEM limit on v5p, which bounds a Pallas kernel that sets none
# (megablox): blocks past it are refused at compile time (CompileTimeScopedVmemOom)
MAXTEXT_SCOPED_VMEM = 16 * 1024 * 1024


def maxtext_gmm_tiles(p: dict) -> dict:
    """MaxText's megablox tile keys (wi / wo x fwd / dlhs / drhs) set to the tiles c2jax's rule
    (pallas_kernels.gmm.tpu.choose_tiling) picks for MaxText's own call shapes: gate and up
    [rows, D] x [D, F] and down [rows, F] x [F, D], their input gradients and weight gradients."""
    import jax.numpy as jnp
    from pallas_kernels.gmm.tpu import VMEM_LIMIT_BYTES, choose_tiling, gmm_vmem_bytes, tgmm_vmem_bytes
    m = c2jax_config(p, None, False).model
    rows, g = maxtext_gmm_rows(p)
    d, f = m.hidden_size, m.moe_intermediate_size
    bf = jnp.dtype(jnp.bfloat16)
    ov = {}
    # (key prefix, kernel, k, n, name of k's dim, name of n's dim) as MaxText's moe.py hands megablox
    for prefix, kind, k, n, kname, nname in (
            ("wi_tile_fwd", "gmm", d, f, "embed_dim", "mlp_dim"), ("wi_tile_dlhs", "gmm", f, d, "mlp_dim", "embed_dim"),
            ("wi_tile_drhs", "tgmm", d, f, "embed_dim", "mlp_dim"), ("wo_tile_fwd", "gmm", f, d, "mlp_dim", "embed_dim"),
            ("wo_tile_dlhs", "gmm", d, f, "embed_dim", "mlp_dim"), ("wo_tile_drhs", "tgmm", f, d, "mlp_dim", "embed_dim")):
        tm, tk, tn = choose_tiling(kind, rows, k, n, g, bf, bf, bf)
        ov.update({f"{prefix}_batch_seq": tm, f"{prefix}_{kname}": tk, f"{prefix}_{nname}": tn})
        vmem = (gmm_vmem_bytes if kind == "gmm" else tgmm_vmem_bytes)((tm, tk, tn), bf, bf, bf)
        if vmem > MAXTEXT_SCOPED_VMEM:
            # megablox sets no VMEM limit of its own; c2jax's kernels ask for VMEM_LIMIT_BYTES, MaxText's
            # documented way to give its kernels the same is a compiler flag (base.yml's compile_xla_flags)
            ov["compile_xla_flags"] = f"--xla_tpu_scoped_vmem_limit_kib={VMEM_LIMIT_BYTES // 1024}"
    return ov


def maxtext_side(p: dict, compiles, out_dir: str, stem: str, timeout: float) -> dict:
    if not os.path.exists(MAXTEXT_PY):
        return {"side": "maxtext", "status": "not run: .venv-maxtext missing (experiments/reference/"
                                             "setup_maxtext_env.sh creates it)", "compiles": {}}
    res = {"side": "maxtext", "compiles": {}}
    for key, layers, unrolled in compiles:
        out = os.path.join(out_dir, "raw", f"{stem}_maxtext_{key}.json")
        log = os.path.join(out_dir, "raw", f"{stem}_maxtext_{key}.log")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = [MAXTEXT_PY, DRIVER, "--out", out, "--", *maxtext_overrides(p, layers, unrolled)]
        print(f"[maxtext] {p['name']}: compiling {key} ...", flush=True)
        t0 = time.time()
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        if "device_count" in env.get("XLA_FLAGS", ""):   # host-device flags are for CPU tests only
            env.pop("XLA_FLAGS")
        with open(log, "w") as lf:
            try:
                rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = round(time.time() - t0, 1)
        if os.path.exists(out):
            with open(out) as f:
                r = json.load(f)
            r.pop("traceback", None)
        else:
            r = {"status": f"error: driver exited {rc} without a report (see {os.path.relpath(log, ROOT)})"}
        rel = [os.path.relpath(c, ROOT) if os.path.isabs(c) else c for c in cmd]
        r.update(layers=layers, scan=not unrolled, subprocess_wall_s=wall,
                 command=" ".join([".venv-maxtext/bin/python", *rel[1:]]))
        for k in ("maxtext", "jax", "libtpu", "flax"):
            if k in r:
                res[k] = r.pop(k)
        r.pop("overrides", None)
        res["compiles"][key] = r
        print(f"[maxtext] {key}: {r.get('status')} in {wall} s (lower {r.get('lower_s')} s, compile "
              f"{r.get('compile_s')} s), memory {r.get('memory')}, cost {r.get('cost')}", flush=True)
    return res


# ----------------------------------------------------------------------------- figures

def extrapolate(lo: dict, hi: dict, n_lo: int, n_hi: int, n_full: int) -> tuple[dict, dict]:
    """(per_layer, whole) of each numeric field: per_layer = (hi - lo) / (n_hi - n_lo),
    whole = lo + (n_full - n_lo) * per_layer."""
    per, whole = {}, {}
    for k in lo:
        if isinstance(lo[k], (int, float)) and isinstance(hi.get(k), (int, float)):
            per[k] = (hi[k] - lo[k]) / (n_hi - n_lo)
            whole[k] = lo[k] + (n_full - n_lo) * per[k]
    return per, whole


# Mosaic kernel name -> the op it computes (c2jax: pallas_kernels/; MaxText: jax's splash attention,
# its megablox grouped matmuls, which lower under the name "_lambda_")
def kernel_family(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "splash", "mha", "_fwd_kernel", "_dq_kernel", "_dkv_kernel")):
        return "attention"
    if "gmm" in n or n == "_lambda_":
        return "experts"
    return "other"


# Kernel families with no pallas_call cost_estimate, for reports written before the driver
# recorded them: c2jax's pallas_kernels then set none (they do since pallas_kernels/cost.py);
# MaxText's megablox sets one, jax's splash none.
NO_ESTIMATE_DEFAULT = {"c2jax": ("attention", "experts"), "maxtext": ("attention",)}


def kernel_flops(cfg, p: dict, chips: int) -> dict:
    """Useful FLOPs per chip of the work the Mosaic kernels do in one full-remat step, per layer:
    experts (per MoE layer) = 4 passes (forward, rematerialized forward, dX, dW) x 2 x tokens x k x
    3 x D x F; attention (per layer) = causal flash: forward 2 x rows x H x L^2 x (d_qk + d_v) / 2,
    run twice (forward, rematerialized forward), backward (3 d_qk + 2 d_v) / (d_qk + d_v) x forward."""
    m = cfg.model
    tokens = p["batch"] * p["seq"] / chips
    experts = 4 * 2 * tokens * m.num_experts_per_tok * 3 * m.hidden_size * m.moe_intermediate_size
    if m.attention == "mla":
        dqk, dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    else:
        dqk = dv = m.head_dim
    fwd = 2 * (p["batch"] / chips) * m.num_heads * p["seq"] ** 2 * (dqk + dv) / 2
    attention = 2 * fwd + fwd * (3 * dqk + 2 * dv) / (dqk + dv)
    n_moe = m.num_layers - m.first_k_dense if m.num_experts else 0
    return {"attention_per_layer": attention, "experts_per_moe_layer": experts if n_moe else 0.0,
            "layers": m.num_layers, "moe_layers": n_moe}


# ----------------------------------------------------------------------------- one cost model

# XLA's TPU cost analysis times a Mosaic call by the estimate its author hands it, as
# pallas_kernels.cost.roofline_seconds (XLA_ROOFLINE's rates) states.


def attention_kind(kernel: str) -> str | None:
    """'fwd' / 'dkv' / 'dq' for a flash / splash attention kernel name, else None."""
    n = kernel.lower()
    if not any(t in n for t in ("flash", "splash", "mha", "_fwd_kernel", "_dq_kernel", "_dkv_kernel")):
        return None
    for kind in ("dkv", "dq", "fwd"):
        if kind in n:
            return kind
    return None


def call_model(call: dict, causal: bool = True) -> dict | None:
    """The one model's {family, flops, bytes} of one Mosaic call (experiments/reference/
    maxtext_aot_driver.py's mosaic_calls record: operand / output shapes, the kernel's blocks),
    by pallas_kernels/cost.py's formulas with the tiling the call's kernel body uses; None for a
    kernel the model does not cover (its own estimate then stands)."""
    from pallas_kernels.cost import flash_traffic, gmm_traffic, tgmm_traffic
    outs = call["outputs"]
    blocks = call.get("blocks") or []
    if blocks:   # the kernel's inputs are the call's last operands (before them: grid bounds, prefetch)
        n_in = len(blocks) - len(outs) - (call.get("scratch") or 0)
        ins = call["operands"][len(call["operands"]) - n_in:]
    else:
        ins = call["operands"][call.get("scalar_prefetch") or 0:]
        n_in = len(ins)

    def block(i):   # the VMEM block of kernel operand i (inputs, then outputs), or None
        if i < len(blocks) and blocks[i][0] == "vmem":
            return blocks[i][2]
        return None

    floats = [i for i, (dt, sh) in enumerate(ins) if dt.startswith(("bf", "f", "e")) and dt != "pred"]
    kind = attention_kind(call["kernel"])
    if kind:
        big = [i for i in floats if len(ins[i][1]) >= 3]
        if len(big) < 3:
            return None
        (dt, q), (_, k), (_, v) = ins[big[0]], ins[big[1]], ins[big[2]]
        b = math.prod(q[:-3]) if len(q) > 3 else 1
        h, lq, d = q[-3:]
        kh, lk, e = k[-3], k[-2], v[-1]
        bq = (block(big[0]) or [512])[-2]
        bk = (block(big[1]) or [512])[-2]
        fused_dq = kind == "dkv" and sum(1 for o in outs if o[1][-3:] == q[-3:]) > 0
        t = flash_traffic(kind, b, h, kh, lq, lk, d, e, causal=causal, by_position=causal and lq != lk,
                          bq=min(bq, lq), bk=min(bk, lk), dtype=dt, fused_dq=fused_dq)
        return {"family": "attention", "kind": kind, "flops": t["flops"], "bytes": t["bytes"]}
    out_rank = len(outs[0][1]) if outs else 0
    r2 = [i for i in floats if len(ins[i][1]) == 2]
    r3 = [i for i in floats if len(ins[i][1]) == 3]
    if out_rank == 3 and len(r2) >= 2:                     # tgmm: [M, K]^T x [M, N] -> [G, K, N]
        g, kk, nn = outs[0][1]
        x, y = ins[r2[0]], ins[r2[1]]
        m = x[1][0] if x[1][1] == kk else x[1][1]
        ob = block(n_in) or [1, 512, 1024]
        xb = block(r2[0]) or [512, 512]
        tm = xb[0] if x[1][1] == kk else xb[1]
        t = tgmm_traffic(m, kk, nn, g, (tm, ob[-2], ob[-1]), x[0], y[0], outs[0][0])
        return {"family": "experts", "kind": "tgmm", "flops": t["flops"], "bytes": t["bytes"]}
    if out_rank == 2 and r2 and r3:                        # gmm: [M, K] x G x [K, N] -> [M, N]
        lhs, rhs = ins[r2[0]], ins[r3[0]]
        m, kk = lhs[1]
        nn = outs[0][1][1]
        g = rhs[1][0]
        lb = block(r2[0]) or [512, 512]
        ob = block(n_in) or [512, 1024]
        t = gmm_traffic(m, kk, nn, g, (lb[0], lb[1], ob[-1]), lhs[0], rhs[0], outs[0][0])
        return {"family": "experts", "kind": "gmm", "flops": t["flops"], "bytes": t["bytes"]}
    return None


def mosaic_model(calls: list[dict], chip: str, causal: bool = True) -> dict:
    """Sums over one compile's Mosaic calls: what their authors' estimates make XLA count
    ("self": flops, bytes, seconds by XLA's roofline) and what the one model counts ("model"),
    per family; kernels the model does not cover keep their own estimates."""
    tot = {w: {"flops": 0.0, "bytes": 0.0, "seconds": 0.0} for w in ("self", "model")}
    fams, unmodeled = {}, {}
    for c in calls:
        n = c.get("count", 1)
        ce = c.get("cost_estimate") or {}
        sf, sb = ce.get("flops", 0.0), ce.get("bytes_accessed", 0.0)
        mod = call_model(c, causal)
        if mod is None:
            unmodeled[c["kernel"]] = unmodeled.get(c["kernel"], 0) + n
            mf, mb, fam = sf, sb, "other"
        else:
            mf, mb, fam = mod["flops"], mod["bytes"], mod["family"]
        for w, f_, b_ in (("self", sf, sb), ("model", mf, mb)):
            sec = roofline_seconds(f_, b_, chip)
            for tgt in (tot[w], fams.setdefault(fam, {}).setdefault(w, {"flops": 0.0, "bytes": 0.0, "seconds": 0.0})):
                tgt["flops"] += n * f_
                tgt["bytes"] += n * b_
                tgt["seconds"] += n * sec
    return {**tot, "families": fams, "unmodeled": unmodeled}


def one_model_figures(comp: dict, chip: str) -> dict | None:
    """A compile's figures under the one cost model: the compiler's optimal_seconds with each
    Mosaic call's self-reported time replaced by the model's (XLA's roofline of each)."""
    if comp.get("status") != "ok" or "mosaic_calls" not in comp:
        return None
    mm = mosaic_model(comp["mosaic_calls"], chip)
    c = comp["cost"]
    return {"optimal_seconds": c["optimal_seconds"] - mm["self"]["seconds"] + mm["model"]["seconds"],
            "flops": c["flops"] - mm["self"]["flops"] + mm["model"]["flops"],
            "bytes_accessed": c["bytes_accessed"] - mm["self"]["bytes"] + mm["model"]["bytes"],
            "kernel_seconds_self": mm["self"]["seconds"], "kernel_seconds_model": mm["model"]["seconds"],
            "kernel_flops_model": mm["model"]["flops"], "kernel_bytes_model": mm["model"]["bytes"],
            "attention_seconds_model": mm["families"].get("attention", {}).get("model", {}).get("seconds", 0.0),
            "experts_seconds_model": mm["families"].get("experts", {}).get("model", {}).get("seconds", 0.0),
            "unmodeled_kernels": len(mm["unmodeled"])}


def xla_roofline(topology: str) -> dict:
    """How XLA's cost analysis times a Mosaic call: optimal_seconds of programs of one (and two)
    copy-kernel Pallas calls on one chip, handed estimates of F FLOPs and B bytes. Gives the rates
    behind pallas_kernels.cost.XLA_ROOFLINE, that the time is max(F / rate, B / bandwidth), that calls add up, and what
    a call without an estimate counts."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.sharding import NamedSharding, PartitionSpec
    from c2jax.tools import compile_check as cc
    dev = cc.topology_devices(topology)[0]
    s = NamedSharding(jax.sharding.Mesh([dev], ("x",)), PartitionSpec())

    def kern(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def program(ce, calls=1, shape=(256, 256)):
        def f(x):
            for _ in range(calls):
                x = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), cost_estimate=ce)(x)
            return x
        c = _cost(jax.jit(f, in_shardings=s, out_shardings=s).lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile())
        return c["optimal_seconds"]

    est = lambda f, b: pl.CostEstimate(flops=int(f), transcendentals=0, bytes_accessed=int(b))
    rows = []
    for f, b, calls in ((1e12, 0, 1), (0, 1e10, 1), (1e12, 1e10, 1), (2e12, 1e10, 1), (1e12, 1e11, 1),
                        (1e12, 0, 2), (0, 1e10, 2)):
        rows.append({"flops": f, "bytes": b, "calls": calls, "optimal_seconds": program(est(f, b), calls)})
    no_est = {"shape": [1024, 1024], "dtype": "float32", "optimal_seconds": program(None, 1, (1024, 1024)),
              "operand_plus_output_bytes": 2 * 1024 * 1024 * 4}
    flops_rate = rows[0]["flops"] / rows[0]["optimal_seconds"]
    bytes_rate = rows[1]["bytes"] / rows[1]["optimal_seconds"]
    return {"topology": topology, "command": " ".join([".venv/bin/python", "experiments/bench/tpu_aot.py",
                                                        "--xla-roofline", topology]),
            "flops_per_s": flops_rate, "bytes_per_s": bytes_rate, "probes": rows, "call_without_estimate": no_est,
            "max_rule_holds": all(abs(r["optimal_seconds"] - r["calls"] * max(r["flops"] / flops_rate,
                                                                              r["bytes"] / bytes_rate))
                                  <= 1e-3 * r["optimal_seconds"] for r in rows),
            "jax": _version("jax"), "libtpu": _version("libtpu")}


def uncounted_families(side: dict, hi_key: str) -> tuple[list, str]:
    hi = side.get("compiles", {}).get(hi_key, {})
    if "kernels_without_cost_estimate" in hi:
        fams = sorted({kernel_family(k) for k in hi["kernels_without_cost_estimate"]} - {"other"})
        return fams, "read from the lowered program (tpu_custom_call sites without cost_estimate)"
    return sorted(NO_ESTIMATE_DEFAULT[side["side"]]), "from the kernels' sources (not recorded by this run)"


def summarize(side: dict, p: dict, n_full: int, peak: float, model_flops_per_chip: float,
              kflops: dict | None = None) -> dict:
    """Adds per_layer / whole cost, peak HBM (and its source) and implied MFU to a side's result;
    with `kflops` (kernel_flops), also optimal_seconds plus the FLOPs of the kernels that carry no
    cost estimate, at peak."""
    c = side.get("compiles", {})
    lo_key, hi_key = f"L{p['layers'][0]}", f"L{p['layers'][1]}"
    if side.get("status", "").startswith("not run"):
        return side
    lo, hi = c.get(lo_key, {}), c.get(hi_key, {})
    if lo.get("status") == "ok" and hi.get("status") == "ok":
        side["per_layer"], side["whole"] = extrapolate(lo["cost"], hi["cost"], p["layers"][0], p["layers"][1], n_full)
        side["mfu_at_optimal_seconds"] = model_flops_per_chip / (side["whole"]["optimal_seconds"] * peak)
        chip = p["topology"].split(":")[0].lower()
        om_lo, om_hi = one_model_figures(lo, chip), one_model_figures(hi, chip)
        if om_lo and om_hi:
            per, whole = extrapolate(om_lo, om_hi, p["layers"][0], p["layers"][1], n_full)
            side["one_model"] = {"per_layer": per, "whole": whole,
                                 "mfu": model_flops_per_chip / (whole["optimal_seconds"] * peak),
                                 "unmodeled_kernels": sorted(mosaic_model(hi["mosaic_calls"], chip)["unmodeled"])}
        mem_per, mem_whole = extrapolate(lo["memory"], hi["memory"], p["layers"][0], p["layers"][1], n_full)
        side["hbm_per_layer_unrolled"] = mem_per
        if kflops:
            fams, how = uncounted_families(side, hi_key)
            extra = ((kflops["attention_per_layer"] * kflops["layers"] if "attention" in fams else 0.0)
                     + (kflops["experts_per_moe_layer"] * kflops["moe_layers"] if "experts" in fams else 0.0))
            side["uncounted_kernels"] = {"families": fams, "how": how, "flops_per_chip": extra}
            side["optimal_seconds_plus_uncounted"] = side["whole"]["optimal_seconds"] + extra / peak
            side["mfu_at_optimal_plus_uncounted"] = model_flops_per_chip / (side["optimal_seconds_plus_uncounted"]
                                                                            * peak)
    full = c.get("full")
    if full and full.get("status") in ("ok", "hbm_oom"):
        side["peak_hbm_gib"] = full["memory"]["peak_gib"]
        side["hbm"] = {k: full["memory"].get(k) for k in ("arguments_gib", "temp_gib", "outputs_gib", "aliased_gib",
                                                          "peak_gib")}
        side["hbm_source"] = (f"full depth ({n_full} layers) compiled with the layers scanned"
                              + ("; the TPU compiler refused it for HBM (temp it asked for)"
                                 if full["status"] == "hbm_oom" else ""))
    elif "hbm_per_layer_unrolled" in side:
        _, whole = extrapolate(lo["memory"], hi["memory"], p["layers"][0], p["layers"][1], n_full)
        side["peak_hbm_gib"] = whole["peak_gib"]
        side["hbm"] = {k: whole.get(k) for k in ("arguments_gib", "temp_gib", "outputs_gib", "aliased_gib",
                                                 "peak_gib")}
        side["hbm_source"] = f"extrapolated linearly from the unrolled {lo_key} and {hi_key} compiles"
    bad = {k: v.get("status") for k, v in c.items() if v.get("status") != "ok"}
    side["status"] = "ok" if not bad and c else f"incomplete: {bad}" if c else side.get("status", "no compiles")
    side["compile_wall_s"] = round(sum((v.get("lower_s") or 0) + (v.get("compile_s") or 0) for v in c.values()), 1)
    return side


def git_state() -> dict:
    """HEAD and whether the model code (c2jax/, pallas_kernels/, configs/) differs from it, when
    the run starts (c2jax is imported from the working tree)."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"c2jax_commit": git("rev-parse", "HEAD") or None,
            "c2jax_tree_dirty": bool(git("status", "--porcelain", "--", "c2jax", "pallas_kernels", "configs"))}


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def model_figures(p: dict) -> dict:
    from c2jax.models import param_count
    from c2jax.train.step import train_flops_per_token
    cfg = c2jax_config(p, None, False)
    counts = param_count(cfg)
    tokens = p["batch"] * p["seq"]
    f = train_flops_per_token(cfg, p["seq"]) * tokens
    chips = chips_of(p["topology"])
    return {"layers": cfg.model.num_layers, "params_total": counts["total"], "params_active": counts["active"],
            "tokens_per_step": tokens, "model_flops_per_step": f, "kernel_flops_per_chip": kernel_flops(cfg, p, chips)}


def layout_notes(p: dict) -> list[str]:
    notes = []
    if p["cp"] > 1:
        notes.append(f"FSDP {p['fsdp']} x CP {p['cp']} x EP {p['ep']}: rows of {p['seq']} tokens split over context "
                     "(c2jax: local queries in zigzag order against all-gathered K/V in its flash kernel; MaxText: "
                     "splash attention with all-gather CP and load balancing); dense weights' embed over fsdp x "
                     "context x expert and expert weights' embed over fsdp x context (both sides; context acts as "
                     "one more FSDP axis for weights), experts over expert, batch over fsdp x expert (both sides).")
    elif p["ep"] == 1:
        notes.append(f"FSDP {p['fsdp']}: both shard dense weights' embed dim over fsdp and gather every "
                     "expert's weights per layer; both split the expert weights' expert dim over fsdp (c2jax's "
                     "mesh rule expert_fsdp, MaxText's shard_exp_on_fsdp=true): whole experts per chip.")
    else:
        notes.append(f"FSDP {p['fsdp']} x EP {p['ep']}: dense weights' embed over fsdp x expert (both sides), "
                     "experts over expert and their embed dim over fsdp (both sides), batch over fsdp x expert "
                     f"(both sides). EP receive buffers: c2jax's capacity {c2jax_capacity(p):g}, MaxText's "
                     f"ragged_buffer_factor {maxtext_matching(p)['ragged_buffer_factor']:g} (above).")
    notes.append("Grouped-matmul tiles: c2jax "
                 + ("picks (tm, tk, tn) per call shape (pallas_kernels.gmm.tpu.choose_tiling: least modelled time "
                    "within 24 MiB of VMEM)" if p.get("c2jax_tiles") == "chosen" else
                    "ran fixed tiles (256, 512, 1024), clamped to each operand (compiled before the per-shape rule)")
                 + "; MaxText "
                 + ("has the same rule's tiles for its own call shapes (its wi_tile_* / wo_tile_* keys)."
                    if p.get("maxtext_tiles") == "chosen" else "runs base.yml's megablox tiles (512 x 1024 x 1024)."))
    mt = maxtext_matching(p)
    if mt:
        notes.append("MaxText settings matching c2jax's at this point: "
                     + ", ".join(f"{k}={v}" for k, v in mt.items()) + ".")
    if p["model"] in ("deepseek_v3_671b", "kimi_k2_1t"):
        notes.append("MLA up-projections (q_b_proj, kv_b_proj; no embed dim): c2jax shards them by heads over "
                     "the embed axes (mesh rule heads -> embed's axes, as configs/pods/kimi_k2_1t.py), MaxText by "
                     "their q_lora / kv_lora dim over the same axes: the same bytes per chip, split along another "
                     "dim. c2jax's aux-loss-free router bias update (model.bias_update_rate 1e-3) is on; MaxText's "
                     "routed_bias_update_rate is 0 (an elementwise update of a [E] vector per layer).")
    if MODELS[p["model"]]["c2jax_model"].get("num_mtp_layers") == 0:
        notes.append("c2jax's model.num_mtp_layers set to 0 (MaxText's config has mtp_num_layers 0).")
    if p.get("c2jax_extra"):
        notes.append(f"c2jax model options beyond the defaults: {p['c2jax_extra']}.")
    if p.get("c2jax_mesh_extra"):
        notes.append(f"c2jax mesh options beyond the point's layout: {p['c2jax_mesh_extra']} (mesh.ep_exchange "
                     "'ragged': only the routed rows sent, receive buffers of ep_capacity_factor x the local "
                     "assignments, 0 = the worst case, dropless).")
    if p["model"] == "tiny":
        notes.append("tiny: a toy Qwen3-MoE shape; MaxText's side (if run) is qwen3-30b-a3b overridden to "
                     "the same dims.")
    return notes


def command_line() -> str:
    """This run's command as a report states it: paths inside the checkout relative to its root."""
    def arg(a):
        return os.path.relpath(a, ROOT) if os.path.isabs(a) and a.startswith(ROOT + os.sep) else a
    return " ".join([".venv/bin/python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *map(arg, sys.argv[1:])])


def run_point(p: dict, sides: list[str], full: bool, out_dir: str, timeout: float, stem: str = "") -> dict:
    """Compile point p's programs on each side; the report (MaxText's raw driver outputs go to
    OUT_DIR/raw/STEM_maxtext_KEY.json / .log, STEM defaulting to DATE_POINT plus the remat suffix)."""
    from c2jax.tools import compile_check as cc
    chip, hbm, peak = cc.chip_spec(p["topology"])
    chips = chips_of(p["topology"])
    figs = model_figures(p)
    n_lo, n_hi = p["layers"]
    compiles = [(f"L{n_lo}", n_lo, True), (f"L{n_hi}", n_hi, True)]
    if full:
        compiles.append(("full", figs["layers"], False))
    date = datetime.datetime.now(datetime.timezone.utc)
    stem = stem or f"{date:%Y-%m-%d}_{p['name']}{remat_suffix(p, sides)}"
    report = {"date": date.strftime("%Y-%m-%d %H:%M UTC"), "point": p["name"],
              "command": command_line(),
              "model": p["model"], "topology": p["topology"], "chip": chip, "chips": chips,
              "hbm_per_chip_gib": hbm / GiB, "peak_bf16_tflops": peak / 1e12,
              "global_batch": p["batch"], "seq_len": p["seq"], "layout": point_layout(p),
              "precision": "f32 params + f32 AdamW moments, bf16 compute",
              "remat": {side: p["remat"][side] for side in sides},
              "extrapolation": {"lo": n_lo, "hi": n_hi, "full": figs["layers"],
                                "rule": "per_layer = (f_hi - f_lo) / (hi - lo); whole = f_lo + (L - lo) * per_layer"},
              **figs, "model_flops_per_chip": figs["model_flops_per_step"] / chips,
              "differences": layout_notes(p) + COMMON_DIFFERENCES, "maxtext_matching": maxtext_matching(p),
              "maxtext_tiles": p.get("maxtext_tiles", "default"), "c2jax_tiles": p["c2jax_tiles"],
              **git_state(), "sides": {}}
    t_all = time.time()
    for side in sides:
        if side == "c2jax":
            s = c2jax_side(p, compiles)
        else:
            s = maxtext_side(p, compiles, out_dir, stem, timeout)
        s["remat"] = p["remat"][side]
        report["sides"][side] = summarize(s, p, figs["layers"], peak, report["model_flops_per_chip"],
                                          figs["kernel_flops_per_chip"] if s["remat"] == "full" else None)
    report["wall_s"] = round(time.time() - t_all, 1)
    report["goals"] = goals(report)
    return report


SAME_PROGRAM_KEYS = ("model", "topology", "global_batch", "seq_len", "layout")


def point_layout(p: dict) -> dict:
    return {"fsdp": p["fsdp"], "ep": p["ep"]} | ({"cp": p["cp"]} if p["cp"] > 1 else {})


def take_maxtext_settings(p: dict, report: dict) -> None:
    """Give point p the MaxText settings a written report's MaxText programs were compiled with
    (its tiles and matching keys as recorded; reports before the tile rule ran base.yml's tiles)."""
    p["maxtext_tiles"] = report.get("maxtext_tiles", "default")
    if "maxtext_matching" in report:
        p["maxtext_matching"] = report["maxtext_matching"]


def reused_maxtext_side(path: str, p: dict) -> dict:
    """The MaxText side of an earlier report whose programs are this point's (same model, topology,
    batch, sequence and mesh), with a note naming where and when it was compiled; p takes that
    report's MaxText settings, so the new report states what the reused programs ran."""
    with open(path) as f:
        old = json.load(f)
    want = {"model": p["model"], "topology": p["topology"], "global_batch": p["batch"], "seq_len": p["seq"],
            "layout": point_layout(p)}
    diff = {k: (old.get(k), want[k]) for k in SAME_PROGRAM_KEYS if old.get(k) != want[k]}
    if diff:
        raise SystemExit(f"--maxtext-from {path}: not the same MaxText programs as {p['name']} (report vs point: {diff})")
    side = old.get("sides", {}).get("maxtext")
    if not side or side.get("status") != "ok":
        raise SystemExit(f"--maxtext-from {path}: no complete MaxText side in it")
    side = dict(side)
    take_maxtext_settings(p, old)
    # a side that was itself reused keeps the note naming its compile
    side.setdefault("note", f"the MaxText programs of {old['point']}, compiled {old['date']} by `{old['command']}`")
    return side


def goals(report: dict) -> dict:
    c, m = report["sides"].get("c2jax", {}), report["sides"].get("maxtext", {})
    out = {}
    if "one_model" in c and "one_model" in m:
        out["step_one_cost_model_le_maxtext"] = (c["one_model"]["whole"]["optimal_seconds"]
                                                 <= m["one_model"]["whole"]["optimal_seconds"])
    if "whole" in c and "whole" in m:
        out["optimal_seconds_le_maxtext"] = c["whole"]["optimal_seconds"] <= m["whole"]["optimal_seconds"]
    if "peak_hbm_gib" in c and "peak_hbm_gib" in m:
        out["peak_hbm_le_maxtext"] = c["peak_hbm_gib"] <= m["peak_hbm_gib"]
    return out


def resummarize(path: str) -> dict:
    """Recompute a written report's figures from its compiles (no compiling); rewrites JSON + md."""
    with open(path) as f:
        r = json.load(f)
    p = point_spec(r["point"])
    sides_remat = {name: s.get("remat", "full") for name, s in r["sides"].items()}
    p = with_remat(p, sides_remat.get("c2jax"), sides_remat.get("maxtext"))
    take_maxtext_settings(p, r)
    p["c2jax_tiles"] = r.get("c2jax_tiles", "fixed")   # reports before the tile rule: fixed tiles
    figs = model_figures(p)
    r.update(figs)
    r["model_flops_per_chip"] = figs["model_flops_per_step"] / r["chips"]
    r["differences"] = layout_notes(p) + COMMON_DIFFERENCES
    r["maxtext_matching"] = maxtext_matching(p)
    peak = r["peak_bf16_tflops"] * 1e12
    r["remat"] = sides_remat
    for name, s in r["sides"].items():
        s.setdefault("side", name)
        s.setdefault("remat", "full")
        r["sides"][name] = summarize(s, p, figs["layers"], peak, r["model_flops_per_chip"],
                                     figs["kernel_flops_per_chip"] if s["remat"] == "full" else None)
    r["goals"] = goals(r)
    with open(path, "w") as f:
        json.dump(r, f, indent=1, default=str)
    with open(path[:-5] + ".md", "w") as f:
        f.write(markdown(r))
    return r


# ----------------------------------------------------------------------------- output

def _f(x, fmt="{:.3g}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def remat_words(r: dict) -> str:
    """Each side's remat policy, as a report states it (older reports: one string, "full")."""
    rm = r.get("remat", "full")
    return rm if isinstance(rm, str) else ", ".join(f"{k} {v}" for k, v in rm.items())


def side_label(name: str, s: dict) -> str:
    return name if s.get("remat", "full") == "full" else f"{name} (remat {s['remat']})"


def markdown(r: dict) -> str:
    lines = [f"# {r['point']}: {r['model']} on {r['topology']} ({r['chips']} x {r['chip']}), "
             f"batch {r['global_batch']} x {r['seq_len']}, "
             + " x ".join(f"{k.upper()} {v}" for k, v in r["layout"].items()),
             "", f"{r['date']}; `{r['command']}`", "",
             f"Model: {r['params_total'] / 1e9:.4g}B params, {r['params_active'] / 1e9:.4g}B active, "
             f"{r['layers']} layers; model FLOPs {r['model_flops_per_step']:.3e} per step "
             f"({r['model_flops_per_chip']:.3e} per chip, 6N + attention). {r['precision']}; remat "
             f"{remat_words(r)}. "
             f"Whole-step cost from unrolled {r['extrapolation']['lo']}- and {r['extrapolation']['hi']}-layer "
             f"compiles: {r['extrapolation']['rule']}.", "",
             "| side | peak HBM / chip GiB (args, temp, out) | HBM from | compiled TFLOPs / chip | bytes accessed / chip "
             "GB | optimal_seconds | per layer: TFLOPs, GB, ms | implied MFU | step, one cost model: s (MFU) | "
             "Mosaic time, one model: attention / experts s (self-reported: all) | Mosaic kernels (hi compile) | "
             "compile s (lo / hi / full) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["sides"].items():
        if s.get("status", "").startswith("not run"):
            lines.append(f"| {name} | {s['status']} | | | | | | | | | | |")
            continue
        label = side_label(name, s)
        h, w, pl = s.get("hbm", {}), s.get("whole", {}), s.get("per_layer", {})
        om = s.get("one_model", {}).get("whole", {})
        hi = s["compiles"].get(f"L{r['extrapolation']['hi']}", {})
        kern = ", ".join(f"{k} x{v}" for k, v in hi.get("mosaic_kernels", {}).items()) or "none"
        times = " / ".join(_f((c.get("lower_s") or 0) + (c.get("compile_s") or 0), "{:.0f}")
                           if c.get("compile_s") is not None else "-" for c in s["compiles"].values())
        src = s.get("hbm_source", "-").split(" compiled")[0].split(" from")[0]
        lines.append(
            f"| {label} | {_f(s.get('peak_hbm_gib'), '{:.2f}')} ({_f(h.get('arguments_gib'), '{:.2f}')}, "
            f"{_f(h.get('temp_gib'), '{:.2f}')}, {_f(h.get('outputs_gib'), '{:.2f}')}) | {src} | "
            f"{_f(w.get('flops', float('nan')) / 1e12, '{:.1f}')} | "
            f"{_f(w.get('bytes_accessed', float('nan')) / 1e9, '{:.1f}')} | {_f(w.get('optimal_seconds'), '{:.3f}')} | "
            f"{_f(pl.get('flops', float('nan')) / 1e12, '{:.2f}')}, {_f(pl.get('bytes_accessed', float('nan')) / 1e9, '{:.1f}')}, "
            f"{_f(pl.get('optimal_seconds', float('nan')) * 1e3, '{:.1f}')} | "
            f"{_f(s.get('mfu_at_optimal_seconds'), '{:.1%}')} | "
            f"{_f(om.get('optimal_seconds'), '{:.3f}')} ({_f(s.get('one_model', {}).get('mfu'), '{:.1%}')}) | "
            f"{_f(om.get('attention_seconds_model'), '{:.3f}')} / {_f(om.get('experts_seconds_model'), '{:.3f}')} "
            f"({_f(om.get('kernel_seconds_self'), '{:.3f}')}) | {kern} | {times} |")
        if s.get("status", "ok") != "ok":
            lines.append(f"| | status: {s['status']} | | | | | | | | | | |")
    g = r.get("goals", {})
    if g:
        lines += ["", "Goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in g.items())]
    lines += ["", "optimal_seconds is the compiler's estimate with each Mosaic call costed by its author's "
              "estimate (splash attention sets none: XLA counts it as free). 'One cost model' replaces every "
              "Mosaic call's cost on both sides by pallas_kernels/cost.py's model of it from the call's shapes "
              "and its kernel's blocks (whole step, extrapolated like the rest; the Mosaic column gives the "
              "model's kernel time and, in brackets, what the authors' estimates made XLA count)."]
    lines += ["", "Differences between the two programs:"] + [f"- {d}" for d in r["differences"]]
    return "\n".join(lines) + "\n"


def summary_table(paths) -> str:
    """One row per point and side, from written reports."""
    rows = ["| point | side | peak HBM / chip GiB (args + temp) | compiled TFLOPs / chip | bytes accessed / chip GB | "
            "optimal_seconds (MFU) | step, one cost model (MFU) | kernels without cost estimate | "
            "compile s (lo / hi / full) |", "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        for name, s in r["sides"].items():
            if s.get("status", "").startswith("not run"):
                rows.append(f"| {r['point']} | {name} | {s['status']} | | | | | | |")
                continue
            h, w = s.get("hbm", {}), s.get("whole", {})
            times = " / ".join(_f((c.get("lower_s") or 0) + (c.get("compile_s") or 0), "{:.0f}")
                               for c in s["compiles"].values())
            rows.append(
                f"| {r['point']} | {side_label(name, s)} | {_f(s.get('peak_hbm_gib'), '{:.2f}')} "
                f"({_f(h.get('arguments_gib'), '{:.2f}')} + "
                f"{_f(h.get('temp_gib'), '{:.2f}')}) | {_f(w.get('flops', float('nan')) / 1e12, '{:.0f}')} | "
                f"{_f(w.get('bytes_accessed', float('nan')) / 1e9, '{:.0f}')} | {_f(w.get('optimal_seconds'), '{:.3f}')} "
                f"({_f(s.get('mfu_at_optimal_seconds'), '{:.1%}')}) | "
                f"{_f(s.get('one_model', {}).get('whole', {}).get('optimal_seconds'), '{:.3f}')} "
                f"({_f(s.get('one_model', {}).get('mfu'), '{:.1%}')}) | "
                f"{', '.join(s.get('uncounted_kernels', {}).get('families', [])) or 'none'} | {times} |")
    return "\n".join(rows) + "\n"


# a report's grouped-matmul tiling (c2jax_tiles / maxtext_tiles) as the best-vs-best tables name it
TILE_WORDS = {"chosen": "per-shape rule", "fixed": "fixed 256x512x1024", "default": "base.yml 512x1024x1024"}


def best_vs_best(paths) -> dict:
    """Per point, each side's fastest step under the one cost model among the written reports'
    candidates (one per remat policy and grouped-matmul tiling) whose peak HBM per chip fits HBM_FIT of the chip's; every
    candidate is listed with its figures."""
    points = {}
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        pt = points.setdefault(r["point"], {"hbm_per_chip_gib": r["hbm_per_chip_gib"], "sides": {}})
        cap = HBM_FIT * r["hbm_per_chip_gib"]
        for name, s in r["sides"].items():
            comps = s.get("compiles", {})
            oom = comps.get("full", {}).get("status") == "hbm_oom"
            if s.get("status") != "ok" and not (oom and all(c.get("status") == "ok" for k, c in comps.items()
                                                            if k != "full")):
                continue   # a candidate whose only failure is the full depth asking for more HBM than a chip has
            step = s.get("one_model", {}).get("whole", {}).get("optimal_seconds")
            hbm = s.get("peak_hbm_gib")
            tiles = (r.get("c2jax_tiles", "fixed") if name == "c2jax" else r.get("maxtext_tiles", "default"))
            pt["sides"].setdefault(name, []).append({
                "remat": s.get("remat", "full"), "tiles": TILE_WORDS[tiles], "step_s": step, "peak_hbm_gib": hbm, "hbm_oom": oom,
                "mfu": s.get("one_model", {}).get("mfu"), "fits": not oom and hbm is not None and hbm <= cap,
                "report": os.path.relpath(os.path.abspath(path), ROOT), "compiled": r["date"],
                "commit": (r.get("c2jax_commit") or "")[:7] if name == "c2jax" else None,
                "note": s.get("note")})
    for pt in points.values():
        for cands in pt["sides"].values():
            seen = {}
            for c in cands:   # a remat and tiling compiled in several reports: the latest report's
                key = (c["remat"], c["tiles"])
                if key not in seen or c["compiled"] > seen[key]["compiled"]:
                    seen[key] = c
            cands[:] = sorted(seen.values(), key=lambda c: (c["step_s"] is None, c["step_s"] or 0))
        best = {name: next((c for c in cands if c["fits"] and c["step_s"] is not None), None)
                for name, cands in pt["sides"].items()}
        pt["best"] = best
        b, m = best.get("c2jax"), best.get("maxtext")
        if b and m:
            pt["maxtext_over_c2jax_step"] = m["step_s"] / b["step_s"]
    return {"hbm_fit": HBM_FIT, "rule": f"fastest step under the one cost model whose peak HBM per chip <= "
                                        f"{HBM_FIT:.0%} of the chip's; same batch, sequence, precision and mesh",
            "command": command_line(), "points": points}


def best_markdown(b: dict) -> str:
    """The best-vs-best table, then every candidate."""
    lines = [f"Rule: {b['rule']}. `{b['command']}`", "",
             "| point | c2jax best (remat, tiles) | step s (MFU) | HBM GiB | MaxText best (remat, tiles) | step s (MFU) | HBM GiB | "
             "MaxText / c2jax step |", "|---|---|---|---|---|---|---|---|"]
    for name, pt in b["points"].items():
        cb, mb = pt["best"].get("c2jax"), pt["best"].get("maxtext")

        def cells(c):
            if not c:
                return "none fits | | "
            return (f"{c['remat']}, {c.get('tiles', '-')} | {c['step_s']:.3f} ({_f(c['mfu'], '{:.1%}')}) | {c['peak_hbm_gib']:.2f}")
        lines.append(f"| {name} | {cells(cb)} | {cells(mb)} | {_f(pt.get('maxtext_over_c2jax_step'), '{:.3f}')} |")
    lines += ["", "| point | side | remat | tiles | step, one cost model s (MFU) | peak HBM / chip GiB | fits | "
                  "report (c2jax commit) |", "|---|---|---|---|---|---|---|---|"]
    for name, pt in b["points"].items():
        for side, cands in pt["sides"].items():
            for c in cands:
                lines.append(f"| {name} | {side} | {c['remat']} | {c.get('tiles', '-')} | {_f(c['step_s'], '{:.3f}')} "
                             f"({_f(c['mfu'], '{:.1%}')}) | {_f(c['peak_hbm_gib'], '{:.2f}')} | "
                             f"{'yes' if c['fits'] else 'no (the compiler refused it for HBM)' if c.get('hbm_oom') else 'no'}"
                             f" | {os.path.basename(c['report'])}{' (' + c['commit'] + ')' if c.get('commit') else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", help="a named point (--list)")
    ap.add_argument("--tiny", action="store_true", help="the tiny point (v5p:2x2x1; c2jax only unless --side)")
    ap.add_argument("--list", action="store_true", help="list the points")
    ap.add_argument("--side", choices=("both", "c2jax", "maxtext"), default=None,
                    help="which programs to compile (default both; c2jax for --tiny)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-depth scanned compile (HBM extrapolated)")
    ap.add_argument("--out-dir", default=DEFAULT_OUT)
    ap.add_argument("--stem", default="", help="output file stem (default DATE_POINT)")
    ap.add_argument("--maxtext-timeout", type=float, default=7200.0, help="seconds per MaxText compile")
    ap.add_argument("--maxtext-from", metavar="JSON",
                    help="with --side c2jax: take the MaxText side from this earlier report of a point with the "
                         "same model, topology, batch, sequence and mesh (the compiler's outputs for the same "
                         "programs; the report says where they came from)")
    ap.add_argument("--resummarize", nargs="+", metavar="JSON",
                    help="recompute written reports' figures and tables from their compiles (no compiling)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print one summary row per point and side")
    ap.add_argument("--c2jax-remat", help="c2jax's model.remat for this run (default full; c2jax.config.REMAT_POLICIES)")
    ap.add_argument("--maxtext-remat", help=f"MaxText's remat_policy for this run (default full; one of {MAXTEXT_REMAT})")
    ap.add_argument("--maxtext-tiles", choices=("chosen", "default"), default="chosen",
                    help="MaxText's megablox tiles: those c2jax's tile rule picks for MaxText's call shapes "
                         "(matching settings, default) or its base.yml defaults")
    ap.add_argument("--best", nargs="+", metavar="JSON",
                    help="best-vs-best: per point and side, the fastest candidate (report) that fits in HBM; writes "
                         "OUT_DIR/best_vs_best.json and .md")
    ap.add_argument("--xla-roofline", metavar="TOPOLOGY",
                    help="measure how XLA's cost analysis times a Mosaic call on this topology's chip (writes "
                         "OUT_DIR/xla_roofline_CHIP.json)")
    args = ap.parse_args(argv)
    if args.xla_roofline:
        r = xla_roofline(args.xla_roofline)
        path = os.path.join(args.out_dir, f"xla_roofline_{args.xla_roofline.split(':')[0]}.json")
        with open(path, "w") as f:
            json.dump(r, f, indent=1)
        print(json.dumps(r, indent=1))
        return 0
    if args.table:
        print(summary_table(args.table), end="")
        return 0
    if args.best:
        b = best_vs_best(args.best)
        with open(os.path.join(args.out_dir, "best_vs_best.json"), "w") as f:
            json.dump(b, f, indent=1)
        md = best_markdown(b)
        with open(os.path.join(args.out_dir, "best_vs_best.md"), "w") as f:
            f.write(md)
        print(md, end="")
        return 0
    if args.resummarize:
        for path in args.resummarize:
            print(markdown(resummarize(path)), flush=True)
        return 0
    if args.list:
        for k, v in POINTS.items():
            print(f"{k}: {v}")
        return 0
    name = "tiny" if args.tiny else args.point
    if not name:
        ap.error("give --point NAME or --tiny")
    p = with_remat(point_spec(name), args.c2jax_remat, args.maxtext_remat)
    p["maxtext_tiles"], p["c2jax_tiles"] = args.maxtext_tiles, "chosen"
    side = args.side or ("c2jax" if name == "tiny" else "both")
    sides = ["c2jax", "maxtext"] if side == "both" else [side]
    reused = None
    if args.maxtext_from:
        if sides != ["c2jax"]:
            ap.error("--maxtext-from goes with --side c2jax")
        reused = reused_maxtext_side(args.maxtext_from, p)   # read before this run may overwrite the file
    report = run_point(p, sides, not args.no_full, args.out_dir, args.maxtext_timeout, args.stem)
    if reused is not None:
        report["sides"]["maxtext"] = reused
        report["goals"] = goals(report)
    report["jax"], report["libtpu"] = _version("jax"), _version("libtpu")
    stem = args.stem or f"{report['date'][:10]}_{name}{remat_suffix(p, sides)}"
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, stem + ".json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = markdown(report)
    with open(os.path.join(args.out_dir, stem + ".md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
