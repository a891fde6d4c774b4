"""Decode throughput of the jitted sampler vs Hugging Face generate (PyTorch CPU peer) and
naive recompute-the-prefix decoding, plus the bytes-moved bound of a decode step.

    JAX_PLATFORMS=cpu python experiments/bench/sampler.py                      # tiny + 89M, batch 1, 8, 32
    JAX_PLATFORMS=cpu python experiments/bench/sampler.py --models 100m --batches 8 --json out.json

All runs are greedy, float32, `prompt_len` random prompt tokens, `new_tokens` new tokens.
- c2jax: `Sampler` with max_batch = batch, the whole decode in one on-device chunk (on CPU the
  split-weight decode step, c2jax.sampling.unrolled: per-layer / per-expert weight buffers),
  decode_devices = --decode-devices (default 2: the two cores of this machine as two host
  devices, experts / attention heads / vocab split over them), and with decode_devices = 1
  ("1 dev") in the same run.
  ms/step = decode time / decode steps; decode tok/s = batch * 1000 / ms_step; e2e tok/s =
  batch * new_tokens / (prefill + decode).
- hf: experiments/reference/hf_generate.py in .venv-ref (Python 3.11, torch CPU) on the SAME
  weights (written with c2jax.hf.save); its ms/step = (t_full - t_1) / (N - 1). Skipped with
  "peer not available" when .venv-ref is missing.
- naive: a jitted full forward over the padded sequence (prompt_len + new_tokens) per token,
  argmax at the current position (fixed shape, one compile); a few steps timed.
- bound: bytes one decode step must move = weights read (all non-embedding params + the
  batch's embedding rows; for MoE only the experts the batch can touch in expectation,
  E * (1 - (1 - K/E)^batch) per layer) + the KV cache read at the mean position, divided
  by the read bandwidth measured just before each row (best of 5 sums of 256 MB; the host is
  shared, so it is re-measured as the load changes). The ratio against the read + write figure
  of an in-place x + 1 (which this host moves ~1.8x faster than reads) is printed beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _decode_devices() -> int:
    """--decode-devices, read before JAX starts: host devices must be asked for in XLA_FLAGS."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--decode-devices", type=int, default=2)
    n = pre.parse_known_args()[0].decode_devices
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}").strip()
    return n


DECODE_DEVICES = _decode_devices()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import c2jax  # noqa: E402
import c2jax.sections  # noqa: E402,F401  (registers the data / eval / rl config sections)
from c2jax.models.transformer import layer_counts, param_count  # noqa: E402
from c2jax.sampling import Request, Sampler  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REF_PY = os.path.join(ROOT, ".venv-ref", "bin", "python")
HF_GEN = os.path.join(ROOT, "experiments", "reference", "hf_generate.py")

# 100m = the PyTorch peer's default shape (experiments/reference/bench_common.py): 88.7M params
MODELS = {
    "tiny": {},
    "100m": {"vocab_size": 8192, "hidden_size": 512, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4, "head_dim": 64,
                 "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 512, "intermediate_size": 1024},
}


def model_config(name: str):
    cfg = c2jax.config.default_config()
    for k, v in MODELS[name].items():
        cfg.model[k] = v
    cfg.model.qk_norm, cfg.model.router, cfg.model.norm_topk_prob = True, "softmax", True
    cfg.model.name = name
    return cfg


def measure_bandwidth(n_bytes: int = 256 << 20, iters: int = 5) -> dict:
    """Best GB/s over n_bytes float32: "read", a sum (a decode step's traffic: weights and cache
    are read, little is written), and "read_write", an in-place x + 1 counted as read + write
    (donated: no fresh allocation, whose page faults would make the figure 10x too low). On
    the Intel host a core's reads stream at ~12 GB/s while reads mixed with writes move ~21 GB/s
    (C AVX-512 loops, experiments/bench/README.md), so the read + write figure is no bound for
    a read stream; both are reported."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    inc = jax.jit(lambda a: a + 1, donate_argnums=0)
    total = jax.jit(jnp.sum)
    x = inc(x)
    jax.block_until_ready(total(x))
    best = {"read": 0.0, "read_write": 0.0}
    for _ in range(iters):
        t = time.perf_counter()
        x = jax.block_until_ready(inc(x))
        best["read_write"] = max(best["read_write"], 2 * n_bytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        jax.block_until_ready(total(x))
        best["read"] = max(best["read"], n_bytes / (time.perf_counter() - t) / 1e9)
    return best


def step_bytes(cfg, batch: int, mean_pos: float) -> float:
    """Ideal bytes one decode step reads (float32 weights and cache)."""
    m = cfg.model
    counts = param_count(cfg)
    _n_dense, n_moe = layer_counts(m)
    weights = counts["total"] - counts["embedding"] + batch * m.hidden_size
    if n_moe:
        E, K = m.num_experts, m.num_experts_per_tok
        expert = 3 * m.hidden_size * m.moe_intermediate_size
        touched = E * (1 - (1 - K / E) ** batch)
        weights -= n_moe * (E - touched) * expert
    if m.attention == "mla":
        per_pos = m.kv_lora_rank + m.qk_rope_head_dim
    else:
        per_pos = 2 * m.num_kv_heads * m.head_dim
    cache = m.num_layers * batch * mean_pos * per_pos
    return 4.0 * (weights + cache)


def bench_c2jax(cfg, params, batch, prompt_len, new_tokens, repeats=2, decode_devices=1):
    rng = np.random.default_rng(0)
    max_len = -(-(prompt_len + new_tokens + 1) // 16) * 16
    s = Sampler(cfg, params, max_batch=batch, max_len=max_len, chunk=new_tokens, decode_devices=decode_devices)

    def once():
        prompts = rng.integers(0, cfg.model.vocab_size, (batch, prompt_len))
        rids = [s.submit(Request(p.tolist(), max_new_tokens=new_tokens, temperature=0.0, reuse_prefix=False))
                for p in prompts]
        t0 = time.perf_counter()
        s._admit()
        jax.block_until_ready(s.state.cur)
        t1 = time.perf_counter()
        steps0 = s.decode_steps
        s.run_until_done()
        t2 = time.perf_counter()
        for r in rids:
            assert len(s.results(r)[0].tokens) == new_tokens
        return t1 - t0, t2 - t1, s.decode_steps - steps0

    once()  # compile
    runs = [once() for _ in range(repeats)]
    tp, td, steps = min(runs, key=lambda r: r[1])
    ms = 1e3 * td / steps
    return {"ms_per_step": ms, "decode_tokens_per_s": batch * 1e3 / ms, "prefill_s": tp, "decode_s": td,
            "decode_steps": steps, "new_tokens_per_s": batch * new_tokens / (tp + td)}


def bench_naive(cfg, params, batch, prompt_len, new_tokens, steps=3):
    L = prompt_len + new_tokens

    @jax.jit
    def step(params, toks, i):  # the training forward as configured (capacity dispatch on CPU)
        logits = c2jax.models.forward(cfg, params, toks)
        nxt = jnp.argmax(logits[:, i - 1], axis=-1).astype(jnp.int32)
        return toks.at[:, i].set(nxt)

    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, L)), jnp.int32)
    jax.block_until_ready(step(params, toks, prompt_len))
    t = time.perf_counter()
    for k in range(steps):
        toks = step(params, toks, prompt_len + k)
    jax.block_until_ready(toks)
    ms = 1e3 * (time.perf_counter() - t) / steps
    return {"ms_per_step": ms, "decode_tokens_per_s": batch * 1e3 / ms, "steps_timed": steps}


def bench_hf(weights_dir, batch, prompt_len, new_tokens, threads):
    if not (os.path.exists(REF_PY) and os.path.exists(HF_GEN)):
        return {"error": "peer not available (.venv-ref or experiments/reference/hf_generate.py missing)"}
    cmd = [REF_PY, HF_GEN, "--weights", weights_dir, "--batch", str(batch), "--prompt-len", str(prompt_len),
           "--new-tokens", str(new_tokens), "--threads", str(threads)]
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "peer timed out"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        return {"error": f"peer failed: {out.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def main() -> int:
    c2jax.hostmem.retain_freed_memory()  # first: host malloc keeps freed memory before XLA's threads start
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--naive-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the peer")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--json", default=None, help="also write all rows to this file")
    ap.add_argument("--decode-devices", type=int, default=2,
                    help="c2jax decode devices (CPU: host devices, one per core); 1 = one device only")
    args = ap.parse_args()

    bw = measure_bandwidth()
    print(json.dumps({"bench": "bandwidth", "GB_per_s": bw, "backend": jax.default_backend(),
                      "devices": str(jax.devices()[0])}), flush=True)
    rows = []
    for name in args.models.split(","):
        cfg = model_config(name)
        params = c2jax.models.init_params(cfg, jax.random.key(0))
        n_params = param_count(cfg)["total"]
        wdir = tempfile.mkdtemp(prefix=f"c2jax_sampler_{name}_")
        peer_ok = not args.no_peer
        if peer_ok:
            c2jax.hf.save(cfg, params, wdir)
        for batch in [int(b) for b in args.batches.split(",")]:
            bw = measure_bandwidth()  # per row: the host is shared, contention changes over the run
            row = {"model": name, "params": n_params, "batch": batch, "prompt_len": args.prompt_len,
                   "new_tokens": args.new_tokens, "bandwidth_GB_s": bw, "loadavg_1m": os.getloadavg()[0]}
            row["decode_devices"] = DECODE_DEVICES
            row["c2jax"] = bench_c2jax(cfg, params, batch, args.prompt_len, args.new_tokens,
                                       decode_devices=DECODE_DEVICES)
            if DECODE_DEVICES > 1:
                row["c2jax_1dev"] = bench_c2jax(cfg, params, batch, args.prompt_len, args.new_tokens)
            nbytes = step_bytes(cfg, batch, args.prompt_len + args.new_tokens / 2)
            row["step_bytes"] = nbytes
            row["bound_ms_per_step"] = bound_ms = 1e3 * nbytes / (bw["read"] * 1e9)
            row["c2jax_over_bound"] = row["c2jax"]["ms_per_step"] / bound_ms
            row["c2jax_over_bound_rw"] = row["c2jax"]["ms_per_step"] / (1e3 * nbytes / (bw["read_write"] * 1e9))
            if not args.no_naive:
                row["naive"] = bench_naive(cfg, params, batch, args.prompt_len, args.new_tokens, args.naive_steps)
            row["hf"] = (bench_hf(wdir, batch, args.prompt_len, args.new_tokens, args.threads) if peer_ok
                         else {"error": "peer skipped (--no-peer)"})
            if "decode_tokens_per_s" in row["hf"]:
                row["speedup_vs_hf_decode"] = row["c2jax"]["decode_tokens_per_s"] / row["hf"]["decode_tokens_per_s"]
                row["speedup_vs_hf_e2e"] = row["c2jax"]["new_tokens_per_s"] / row["hf"]["new_tokens_per_s"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    print()
    print("| model | batch | read GB/s | r+w GB/s | c2jax ms/step | c2jax decode tok/s | c2jax 1 dev ms/step | HF ms/step "
          "| HF decode tok/s | x HF | naive ms/step | bound ms/step | c2jax / bound | c2jax / bound at r+w GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf = r["hf"]
        hf_ms = f"{hf['ms_per_step']:.1f}" if "ms_per_step" in hf else "n/a"
        hf_tps = f"{hf['decode_tokens_per_s']:.0f}" if "decode_tokens_per_s" in hf else hf.get("error", "n/a")
        sp = f"{r['speedup_vs_hf_decode']:.2f}" if "speedup_vs_hf_decode" in r else "n/a"
        nv = f"{r['naive']['ms_per_step']:.1f}" if "naive" in r else "n/a"
        one = f"{r['c2jax_1dev']['ms_per_step']:.2f}" if "c2jax_1dev" in r else "(same)"
        bw = r["bandwidth_GB_s"]
        print(f"| {r['model']} | {r['batch']} | {bw['read']:.1f} | {bw['read_write']:.1f} | "
              f"{r['c2jax']['ms_per_step']:.2f} | "
              f"{r['c2jax']['decode_tokens_per_s']:.0f} | {one} | {hf_ms} | {hf_tps} | {sp} | {nv} | "
              f"{r['bound_ms_per_step']:.2f} | {r['c2jax_over_bound']:.2f} | {r['c2jax_over_bound_rw']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
