"""Load time and peak host memory of a ~1 GB synthetic DeepSeek-V3-shaped bf16 checkpoint:
c2jax.hf.load (one device, and 8 fake devices with the tiny v5p-8 pod's FSDP / EP rules) against
safetensors.torch.load_file and transformers' from_pretrained in the reference environment.

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python experiments/bench/hf_load.py [--dir /tmp/hf_load_1g] \
        [--runs 3] [--out experiments/results/hf_load/hf_load_DATE.json]

Each measurement runs in its own process and loads once; the checkpoint is written once
(c2jax.hf.save, bfloat16, 4 shards) and read through before each run, so the page cache is warm and
the numbers compare the loaders, not the disk. Memory: `peak_rss_gb` is the process's peak RSS;
`over_result_gb` = peak RSS - RSS before the load - bytes of the loaded tensors, i.e. what the load
needed beyond its result (on CPU devices the params themselves are host memory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HF = dict(hidden_size=1024, num_hidden_layers=5, first_k_dense_replace=1, intermediate_size=2816,
          moe_intermediate_size=512, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=1,
          n_group=8, topk_group=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384,
          kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, vocab_size=32768,
          routed_scaling_factor=2.5, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
          model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], tie_word_embeddings=False,
          rope_theta=10000.0, dtype="bfloat16")


def make(path: str) -> None:
    import jax
    import numpy as np

    import c2jax
    from c2jax.hf.config import config_from_hf
    from c2jax.models.transformer import abstract_params
    m = config_from_hf(HF)
    m.param_dtype = "bfloat16"
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (rng.standard_normal(s.shape, np.float32) * 0.02).astype(s.dtype),
                          abstract_params(m))
    c2jax.hf.save(m, params, path, max_shard_bytes=300 << 20, dtype="bfloat16")


def run_c2jax(path: str, devices: int) -> dict:
    import resource

    import jax

    import c2jax
    shardings = None
    if devices > 1:
        import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
        from c2jax.config import load_config
        from c2jax.hf.config import config_from_hf
        from c2jax.models import param_shardings
        from c2jax.parallel import make_mesh
        cfg = load_config(os.path.join(ROOT, "configs", "pods", "tiny_v5p_8.py"), [], validate_devices=devices)
        cfg.model = config_from_hf(json.load(open(os.path.join(path, "config.json"))))
        cfg.model.param_dtype = "bfloat16"
        shardings = param_shardings(cfg, make_mesh(cfg))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    stats = {}
    _, params = c2jax.hf.load(path, shardings=shardings, dtype="bfloat16", stats=stats)
    jax.block_until_ready(params)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)
    return {"loader": f"c2jax.hf.load ({devices} device{'s' if devices > 1 else ''})", "seconds": round(secs, 2),
            "peak_rss_gb": round(peak / 2 ** 20, 2), "over_result_gb": round((peak - before) / 2 ** 20 - result / 2 ** 30, 2),
            "bytes_read_gb": round(stats["bytes_read"] / 2 ** 30, 3), "slice_reads": len(stats["reads"])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/hf_load_1g")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=1, help="loads per loader (each in a fresh process)")
    ap.add_argument("--out", default=None, help="write the rows and their spread here as JSON")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_c2jax(args.dir, int(args.child))))
        return 0
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        make(args.dir)
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    rows = [{"checkpoint_gb": round(size / 2 ** 30, 3)}]

    def warm():
        for f in os.listdir(args.dir):
            with open(os.path.join(args.dir, f), "rb") as fh:
                while fh.read(64 << 20):
                    pass
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    ref_py = os.path.join(ROOT, ".venv-ref", "bin", "python")
    for _ in range(args.runs):   # loaders interleaved, so host load drifts hit them alike
        for devices in (1, 8):
            warm()
            e = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
            out = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--child", str(devices)], env=e,
                                 capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        for how in ("safetensors", "transformers"):
            warm()
            out = subprocess.run([ref_py, os.path.join(ROOT, "experiments", "reference", "hf_load_reference.py"),
                                  args.dir, how], capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    for r in rows:
        print(json.dumps(r))
    if args.out:
        _write(args.out, rows, args)
    return 0


def _loader(r: dict) -> str:
    return str(r.get("loader") or r.get("how") or f"c2jax_{r.get('devices')}dev")


def _write(path: str, rows: list, args) -> None:
    """The rows, and per loader the median / min / max seconds over the runs, with date, host load
    and command."""
    import platform
    import statistics
    by = {}
    for r in rows[1:]:
        secs = r.get("seconds", r.get("load_s"))
        if secs is not None:
            by.setdefault(_loader(r), []).append(float(secs))
    spread = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": len(v)}
              for k, v in by.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.processor() or
                   platform.machine(), "load_average_1m": os.getloadavg()[0],
                   "command": "python experiments/bench/hf_load.py " + " ".join(sys.argv[1:]),
                   "checkpoint_gb": rows[0]["checkpoint_gb"], "spread": spread, "rows": rows[1:]}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
