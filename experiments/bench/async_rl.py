"""Asynchronous vs synchronous RL: wall time to train the same number of groups with
staleness=0 (the synchronous algorithm) and with the async setting, in the same process (the
compiles are warmed first and shared), plus each run's sampler idle fraction.

    JAX_PLATFORMS=cpu python experiments/bench/async_rl.py                          # toy task
    JAX_PLATFORMS=cpu python experiments/bench/async_rl.py --config configs/rl_tiny.py \
        --steps 6 --config.train.init_from=runs/demo/sft                           # agent harness
    JAX_PLATFORMS=cpu python experiments/bench/async_rl.py --config.rl.toy_latency_s=0.3 \
        --config.rl.toy_latency_sigma=1.0       # remote environments: heavy-tailed episode latency
    ... --json experiments/results/async_rl/toy.json

Speedup = sync wall / async wall over the training steps only (no evals).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None):
    from c2jax import hostmem
    hostmem.retain_freed_memory()  # first: host malloc keeps freed memory before XLA's threads start
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/rl_tiny.py:toy")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=2, help="the async run's rl.staleness")
    ap.add_argument("--json", default="")
    args, rest = ap.parse_known_args(argv)
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    logging.basicConfig(level=logging.WARNING)
    import jax
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    from c2jax.rl.loop import run_rl
    # Each run_rl builds its own jitted learner/sampler; a persistent compilation cache makes the
    # warm-up runs' compiles the timed runs' too, so train_wall_s measures training, not XLA.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="c2jax_async_bench_xla_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def run(staleness, steps, tag, root):
        cfg = load_config(args.config, list(rest) + [f"--config.rl.steps={steps}", "--config.rl.eval_every=-1",
                                                     f"--config.rl.staleness={staleness}"])
        t0 = time.time()
        s = run_rl(cfg, os.path.join(root, tag))
        rows = [json.loads(line) for line in open(os.path.join(root, tag, "metrics.jsonl"))]
        rows = [r for r in rows if "reward" in r]
        steady = (rows[-1]["time"] - rows[0]["time"]) / max(len(rows) - 1, 1)
        return {"staleness": staleness, "steps": steps, "train_wall_s": s["train_wall_s"],
                "steady_s_per_step": steady,  # steps 2..N: excludes the first step's late compiles
                "total_s": time.time() - t0, "sampler_idle_fraction": s["sampler_idle_fraction"],
                "groups": s["groups_consumed"], "reward_mean": sum(r["reward"] for r in rows) / len(rows),
                "staleness_mean": sum(r["staleness_mean"] for r in rows) / len(rows),
                "sync_delta_ratio": rows[-1].get("sync/delta_ratio")}

    with tempfile.TemporaryDirectory() as root:
        run(0, 3, "warmup_sync", root)            # compiles (sampler, learner) shared by both runs
        run(args.staleness, 3, "warmup_async", root)
        sync = run(0, args.steps, "sync", root)
        asyn = run(args.staleness, args.steps, "async", root)
    out = {"config": args.config, "overrides": rest, "sync": sync, "async": asyn,
           "speedup": sync["train_wall_s"] / asyn["train_wall_s"],
           "speedup_steady": sync["steady_s_per_step"] / asyn["steady_s_per_step"],
           "cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg()}
    print(json.dumps(out, indent=2))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
