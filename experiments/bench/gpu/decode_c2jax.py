"""c2jax sampler decode ms/step and its bytes-moved bound on the default JAX backend, one JSON line per batch.

    python3 experiments/bench/gpu/decode_c2jax.py --model 100m --batches 8,64,1 --weights-dir /tmp/w --jsonl OUT.jsonl

Reuses experiments/bench/sampler.py: model_config (the 100m shape = the HF peer's default),
bench_c2jax (Sampler, max_batch = batch, the whole decode in one on-device chunk; greedy, float32,
random prompts; best of 2 timed runs after a compile run), step_bytes (ideal bytes per decode
step: non-embedding weights, the experts the batch can touch in expectation, the KV cache at the
mean position; float32) and measure_bandwidth (in-place x + 1 and a sum; here over --bw-bytes,
2 GiB by default, since 256 MB takes ~0.1 ms on an H200 and timer overhead would dominate).
The weights are written with c2jax.hf.save to --weights-dir first, so hf_generate_gpu.py (run
after this process exits, so the two frameworks never share the GPU's memory) decodes the SAME
weights. Variants: "default" is the sampler as configured (its kernels as c2jax.ops chooses them for
the GPU, recorded per row); "grouped" pins the routed experts to the sorted grouped matmuls.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import BENCH, Deadline, default_budget, emit, load_module  # noqa: E402

VARIANTS = {"default": {}, "grouped": {"kernels.experts": "xla_grouped"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="100m")
    ap.add_argument("--batches", default="8,64,1")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--variants", default="default,grouped", help=f"comma list of {sorted(VARIANTS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="cfg.model overrides for every row (e.g. a small shape for a CPU smoke test)")
    ap.add_argument("--weights-dir", default="", help="write the weights here (HF format) for the HF peer")
    ap.add_argument("--bw-bytes", type=int, default=2 << 30)
    ap.add_argument("--budget-s", type=float, default=default_budget(),
                    help="start no optional row past this (s; default: $PART_LIMIT - 15, else none)")
    ap.add_argument("--jsonl", default=None)
    args = ap.parse_args(argv)
    deadline = Deadline(args.budget_s)

    sb = load_module("bench_sampler", os.path.join(BENCH, "sampler.py"))
    import jax

    import c2jax
    from c2jax.config import apply_overrides
    from c2jax.ops import record_choices
    from c2jax.models.transformer import param_count

    bws = sb.measure_bandwidth(n_bytes=args.bw_bytes, iters=10)   # {"read", "read_write"} GB/s
    bw = bws["read"]   # a decode step reads weights and cache and writes little
    dev = jax.devices()[0]
    emit({"part": "decode_env", "impl": "c2jax", "jax": jax.__version__, "backend": jax.default_backend(),
          "device": str(dev), "device_kind": getattr(dev, "device_kind", ""), "bandwidth_GB_s": bw, "bandwidth_read_write_GB_s": bws["read_write"],
          "bw_bytes": args.bw_bytes}, args.jsonl)
    batches = [int(b) for b in args.batches.split(",") if b]
    saved = False
    slowest = 0.0
    for vi, variant in enumerate(v for v in args.variants.split(",") if v):
        cfg = sb.model_config(args.model)
        apply_overrides(cfg, {f"model.{k}": v for k, v in VARIANTS[variant].items()})
        apply_overrides(cfg, [s if s.startswith("model.") else "model." + s for s in args.set])
        params = c2jax.models.init_params(cfg, jax.random.key(0))
        if args.weights_dir and not saved:
            t = time.perf_counter()
            c2jax.hf.save(cfg, params, args.weights_dir)
            saved = True
            emit({"part": "decode_weights", "impl": "c2jax", "dir": args.weights_dir,
                  "save_s": time.perf_counter() - t}, args.jsonl)
        n_params = param_count(cfg)["total"]
        for bi, batch in enumerate(batches):
            if (vi or bi) and deadline.left() < 1.5 * slowest + 5:
                emit({"part": "decode", "impl": "c2jax", "variant": variant, "batch": batch,
                      "skipped": f"budget: {deadline.left():.0f} s left, slowest row took {slowest:.0f} s"},
                     args.jsonl)
                continue
            t = time.perf_counter()
            row = {"part": "decode", "impl": "c2jax", "variant": variant, "model": args.model, "params": n_params,
                   "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "dtype": cfg.model.dtype, "dispatch": "dropless"}   # the sampler never drops tokens
            try:
                with record_choices() as kernels:   # what the sampler's programs ran, as traced
                    row.update(sb.bench_c2jax(cfg, params, batch, args.prompt_len, args.new_tokens))
                row["kernels"] = kernels
                bound_ms = 1e3 * sb.step_bytes(cfg, batch, args.prompt_len + args.new_tokens / 2) / (bw * 1e9)
                row.update(bandwidth_GB_s=bw, bound_ms_per_step=bound_ms,
                           c2jax_over_bound=row["ms_per_step"] / bound_ms)
            except Exception as e:
                import traceback
                traceback.print_exc()
                row["error"] = repr(e)[-1500:]
            row["row_wall_s"] = time.perf_counter() - t
            slowest = max(slowest, row["row_wall_s"])
            emit(row, args.jsonl)
        del params
        jax.clear_caches()
    return 0


if __name__ == "__main__":
    sys.exit(main())
