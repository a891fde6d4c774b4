"""c2jax training-step throughput and MFU on the default JAX backend (the H200 run), one JSON line per variant.

    python3 experiments/bench/gpu/train_c2jax.py --batch 32 --seq 2048 --variants bf16,f32 --jsonl OUT.jsonl

Same model, step and optimizer as experiments/bench/train_step.py (its OVERRIDES and parameter
check are imported from there: 89M Qwen3-MoE, every layer MoE, untied head, AdamW + clip 1.0),
with per-variant overrides for the GPU:
  bf16          model.dtype=bfloat16 (f32 master weights), capacity dispatch, capacity_factor 1.25
  bf16_pbf16    as bf16 with param_dtype bfloat16 (pure bf16 weights, like the HF peer's bf16 mode)
  bf16_cf2      as bf16 with capacity_factor 2.0
  bf16_cf8      as bf16 with capacity_factor 8.0 (train_step.py's CPU setting: capacity = all tokens,
                8x the routed expert FLOPs on this batched-einsum path)
  bf16_grouped  as bf16 with moe_dispatch=dropless (dropless: XLA's ragged_dot on GPU, c2jax.ops' auto)
  bf16_scan     as bf16_grouped with the experts pinned to pallas_kernels' row-tiled XLA scan
  bf16_xla_attn as bf16_grouped with attention pinned to XLA's blocked causal form (auto: cuDNN)
  f32           model.dtype=float32, capacity_factor 1.25
--model study runs configs/gpu_study.py (1.40B Qwen3-MoE, 24 layers scanned) with the same
peer-compatible settings; --profile-dir DIR traces two steps of each variant and adds the top
device ops by time to its row (profile_summary.py).
The capacity path on GPU gathers each expert's first C = factor * T * K / E assignments into one
batched einsum; the dropped fraction (random tokens, fresh router) is reported with each row.
MFU = flops_per_token (c2jax.models.flops_per_token, useful matmul FLOPs) x tokens/s / peak, against
790 TFLOP/s (H200 bf16, measured), the 989.5 datasheet figure, and an 8192^3 bf16 jnp matmul
measured here. Optional variants after the first start only while --budget-s allows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import (BENCH, H200_BF16_MEASURED, H200_BF16_SPEC, ROOT, Deadline,  # noqa: E402
                        default_budget, emit, load_module)

VARIANTS = {
    "bf16": {"model.dtype": "bfloat16", "model.capacity_factor": 1.25},
    "bf16_pbf16": {"model.dtype": "bfloat16", "model.param_dtype": "bfloat16", "model.capacity_factor": 1.25},
    "bf16_cf2": {"model.dtype": "bfloat16", "model.capacity_factor": 2.0},
    "bf16_cf8": {"model.dtype": "bfloat16", "model.capacity_factor": 8.0},
    "bf16_grouped": {"model.dtype": "bfloat16", "model.moe_dispatch": "dropless"},
    "bf16_scan": {"model.dtype": "bfloat16", "model.moe_dispatch": "dropless", "model.kernels.experts": "xla_grouped"},
    "bf16_xla_attn": {"model.dtype": "bfloat16", "model.moe_dispatch": "dropless",
                      "model.kernels.attention": "xla_blocked"},
    "f32": {"model.dtype": "float32", "model.capacity_factor": 1.25},
}
MODELS = {"l": ("ablation.py:l", {}), "study": ("gpu_study.py", {"model.scan_unroll": 1})}
# the row-tiled scan is a sequential loop of ~(T*K/128 + E) small matmuls per grouped matmul
# (~10^4-10^5 loop steps per train step), so it gets fewer timed steps
MAX_STEPS = {"bf16_scan": 3}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compile")
    ap.add_argument("--variants", default="bf16,f32,bf16_grouped", help=f"comma list of {sorted(VARIANTS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra overrides for every variant (e.g. a small shape for a CPU smoke test)")
    ap.add_argument("--peak-n", type=int, default=8192, help="n of the n^3 bf16 matmul peak probe (0 = skip)")
    ap.add_argument("--budget-s", type=float, default=default_budget(),
                    help="start no optional variant past this (s; default: $PART_LIMIT - 15, else none)")
    ap.add_argument("--model", choices=sorted(MODELS), default="l",
                    help="l: the 89M benchmark model; study: configs/gpu_study.py (1.40B)")
    ap.add_argument("--profile-dir", default=None, help="trace two steps per variant here; top ops go in the row")
    ap.add_argument("--jsonl", default=None)
    return ap.parse_args(argv)


def matmul_peak(n: int, dtype, iters: int = 20) -> float:
    """FLOP/s of an n^3 matmul in `dtype`: `iters` back-to-back dispatches, one sync (steady state)."""
    import jax
    import jax.numpy as jnp
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        outs = [f(a, b) for _ in range(iters)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t) / iters)
    return 2 * n ** 3 / best


def run_variant(args, ts, name: str, peaks: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import apply_overrides, load_config_file, validate
    from c2jax.models import init_params, param_count
    from c2jax.train.step import train_flops_per_token
    from c2jax.ops import record_choices
    from c2jax.train.optimizer import make_optimizer
    from c2jax.train.step import init_state, make_train_step

    B, L = args.batch, args.seq
    config_file, model_overrides = MODELS[args.model]
    cfg = load_config_file(os.path.join(ROOT, "configs", config_file))
    apply_overrides(cfg, {**ts.OVERRIDES, **model_overrides, "train.batch_size": B, "train.seq_len": L})
    apply_overrides(cfg, VARIANTS[name])
    apply_overrides(cfg, list(args.set))
    validate(cfg)
    counts = param_count(cfg)
    fpt = train_flops_per_token(cfg, L)
    optimizer = make_optimizer(cfg.train)
    params = init_params(cfg, jax.random.key(0))
    state = init_state(cfg, optimizer, params, seed=0)
    del params
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
             "segment_ids": jnp.ones((B, L), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
             "loss_weights": jnp.ones((B, L), jnp.float32)}
    step = make_train_step(cfg, optimizer)
    t = time.perf_counter()
    with record_choices() as kernels:   # the implementation each op ran in the step, as traced
        compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    losses, dropped, times = [], [], []
    n_steps = min(args.steps, MAX_STEPS.get(name, args.steps))
    t = time.perf_counter()
    for _ in range(min(args.warmup, n_steps)):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    warmup_s = time.perf_counter() - t
    for _ in range(n_steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
        dropped.append(float(metrics.get("dropped_fraction", 0.0)))
    # pipelined: the same steps dispatched back to back, one sync at the end (no per-step host sync)
    t0 = time.perf_counter()
    for _ in range(n_steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    pipelined_s = (time.perf_counter() - t0) / max(n_steps, 1)
    profile = None
    if args.profile_dir:
        from profile_summary import newest_trace, top_ops
        trace_dir = os.path.join(args.profile_dir, f"{args.model}_{name}")
        jax.profiler.start_trace(trace_dir)
        for _ in range(2):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        profile = top_ops(newest_trace(trace_dir), 15)
    step_s = statistics.median(times)
    tps = B * L / step_s
    mem = {}
    try:
        stats = jax.devices()[0].memory_stats() or {}
        mem = {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}
    except Exception as e:  # CPU backends may not report
        mem = {"error": repr(e)[:200]}
    row = {
        "part": "train", "impl": "c2jax", "model": args.model, "variant": name, "overrides": {**VARIANTS[name], **dict(
            s.split("=", 1) for s in args.set)},
        "dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype,
        "dispatch": cfg.model.moe_dispatch, "capacity_factor": cfg.model.capacity_factor,
        "kernels": kernels,
        "batch": B, "seq": L, "tokens_per_step": B * L,
        "params": counts["total"], "params_match_peer": counts["total"] == ts.PEER_PARAMS if args.model == "l" else None,
        "flops_per_token": fpt,
        "step_s_median": step_s, "step_s": [round(x, 5) for x in times],
        "step_s_pipelined": pipelined_s,
        "tokens_per_s": tps, "tokens_per_s_pipelined": B * L / pipelined_s,
        "achieved_tflops": fpt * tps / 1e12,
        "mfu_vs_790": fpt * tps / H200_BF16_MEASURED, "mfu_vs_spec_989": fpt * tps / H200_BF16_SPEC,
        "compile_s": compile_s, "warmup_s": warmup_s,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "max_dropped_fraction": max(dropped) if dropped else None, "memory": mem,
    }
    if profile is not None:
        row["profile"] = profile
    if peaks.get("bf16"):
        row["mfu_vs_measured_bf16"] = fpt * tps / peaks["bf16"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = Deadline(args.budget_s)
    ts = load_module("bench_train_step", os.path.join(BENCH, "train_step.py"))
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    env = {"part": "train_env", "impl": "c2jax", "jax": jax.__version__, "backend": jax.default_backend(),
           "device": str(dev), "device_kind": getattr(dev, "device_kind", ""),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "default_matmul_precision": str(jax.config.jax_default_matmul_precision)}
    peaks = {}
    if args.peak_n:
        try:
            peaks["bf16"] = matmul_peak(args.peak_n, jnp.bfloat16)
            peaks["f32"] = matmul_peak(args.peak_n, jnp.float32, iters=5)
        except Exception as e:
            env["peak_error"] = repr(e)[:300]
    env.update({f"matmul_peak_{k}_tflops": v / 1e12 for k, v in peaks.items()}, peak_n=args.peak_n)
    emit(env, args.jsonl)
    first_cost = None
    for i, name in enumerate(v for v in args.variants.split(",") if v):
        if name not in VARIANTS:
            emit({"part": "train", "impl": "c2jax", "variant": name, "error": "unknown variant"}, args.jsonl)
            continue
        if i and first_cost is not None and deadline.left() < 1.3 * first_cost + 5:
            emit({"part": "train", "impl": "c2jax", "variant": name,
                  "skipped": f"budget: {deadline.left():.0f} s left, first variant took {first_cost:.0f} s"},
                 args.jsonl)
            continue
        t = time.perf_counter()
        try:
            row = run_variant(args, ts, name, peaks)
        except Exception as e:
            import traceback
            traceback.print_exc()
            row = {"part": "train", "impl": "c2jax", "variant": name, "error": repr(e)[-1500:]}
        row["variant_wall_s"] = time.perf_counter() - t
        if first_cost is None:
            first_cost = row["variant_wall_s"]
        emit(row, args.jsonl)
        jax.clear_caches()
    return 0


if __name__ == "__main__":
    sys.exit(main())
