"""Training-step throughput and MFU of c2jax vs the Hugging Face PyTorch peer, same shape, same run.

    JAX_PLATFORMS=cpu .venv/bin/python experiments/bench/train_step.py
    JAX_PLATFORMS=cpu .venv/bin/python experiments/bench/train_step.py --steps 3 --rounds 2 --no-peer

Model: configs/ablation.py:l (89M Qwen3-MoE: 6 layers, hidden 512, 16 experts top-2 of width 512,
heads 8 / kv 4, head_dim 64, vocab 8192) with every layer MoE and an untied head, exactly the
peer's shape (experiments/reference/bench_common.py; the parameter counts are checked equal).
Step: c2jax.train.step.make_train_step with c2jax.train.optimizer.make_optimizer (AdamW b1 0.9,
b2 0.95, wd 0.1, global-norm clip 1.0), float32, batch 8 x 512 random tokens, next-token loss.
Peer: experiments/reference/hf_train_step.py in .venv-ref (torch CPU, AdamW, same betas/wd, no clip).
Both sides run with glibc malloc keeping freed memory (c2jax.hostmem; the peer through
GLIBC_TUNABLES): without it each step of either faults in ~2 GB of fresh pages.

Interleaving: the machine is shared, so timings drift; the c2jax timed steps are split into
rounds run before and after each peer subprocess (ours, peer, ours, peer, ..., ours), and the
matmul peak (c2jax.train.metrics.measured_matmul_peak, best of 3 runs of the compiled 1024^3
product, ~40 ms) is sampled right before every timed c2jax step and after the last one (the
machine's speed drifts by 1.5x within minutes).
Reported: median and best (fastest) step time over all timed steps of each side, and the ratio of
each; other load on the machine only adds time, and it slows the PyTorch peer far more than XLA,
so the best-step ratio is the one to quote when the two differ. MFU = flops_per_token x tokens/s
/ peak (FLOPs from c2jax.models.flops_per_token: useful matmul FLOPs only, so capacity padding
or recomputation count against MFU), two ways:
  - strict: the median (best) step against the best peak sample of the whole run, which mixes
    the slow minutes of one with the fast minutes of the other;
  - paired: each c2jax step against the larger of the two samples taken just before and just
    after it (the machine's speed while it ran), then the median (best) over the steps.

XLA CPU flags, if any, are set here only (before jax is imported), never in the library.
The CPU training kernels (attention, experts, NLL: c2jax.backends.cpu.kernels) run when they can;
`C2JAX_CPU_KERNELS=0 ... train_step.py` measures the same step through XLA's paths.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REF_PY = os.path.join(ROOT, ".venv-ref", "bin", "python")
HF_STEP = os.path.join(ROOT, "experiments", "reference", "hf_train_step.py")
PEER_PARAMS = 88_661_248  # experiments/reference/README.md

# Bench-only overrides of configs/ablation.py:l so it is exactly the peer's model.
OVERRIDES = {
    "model.num_mtp_layers": 0, "model.first_k_dense": 0, "model.tie_embeddings": False, "model.qk_norm": True, "model.router": "softmax",
    "model.norm_topk_prob": True, "model.num_shared_experts": 0, "model.rope_theta": 10000.0,
    "model.rms_norm_eps": 1e-6, "model.load_balance_loss_weight": 0.0, "model.router_z_loss_weight": 0.0,
    "model.dtype": "float32", "model.param_dtype": "float32", "model.remat": "none",
    "train.weight_decay": 0.1, "train.b1": 0.9, "train.b2": 0.95, "train.grad_accum": 1, "train.z_loss": 0.0,
    "train.warmup_steps": 0, "train.lr": 1e-4,
    # capacity = factor * T * K / E = T: nothing can drop, so the MoE is dropless like the peer's (with
    # the CPU block path the cost follows the real expert loads, not the capacity)
    "model.moe_dispatch": "capacity", "model.capacity_factor": 8.0,
    # six layers compile as straight-line code: no per-layer slicing of the stacked weights, gradients
    # and saved activations in and out of the scan's loop buffers (~0.1-0.2 s of a ~3.9 s step here)
    "model.scan_unroll": 6,
}


def build_step(batch_size: int, seq: int, overrides=()):
    """(cfg, mesh, compiled step, state, batch, compile s) of the bench's model and step, laid out as
    the trainer lays them out (c2jax.train.loop): a mesh over every device (one here unless
    --xla-flags=--xla_force_host_platform_device_count=N), state and batch placed on it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import apply_overrides, load_config_file, validate
    from c2jax.models import init_params, param_count
    from c2jax.models import param_shardings
    from c2jax.parallel import activate, data_sharding, make_mesh
    from c2jax.train.optimizer import make_optimizer
    from c2jax.train.step import init_sharded_state, make_train_step

    cfg = load_config_file(os.path.join(ROOT, "configs", "ablation.py") + ":l")
    apply_overrides(cfg, {**OVERRIDES, "train.batch_size": batch_size, "train.seq_len": seq})
    apply_overrides(cfg, list(overrides))
    validate(cfg)
    total = param_count(cfg)["total"]
    if total != PEER_PARAMS:
        raise SystemExit(f"c2jax model has {total:,} params, peer {PEER_PARAMS:,}: shapes differ")
    optimizer = make_optimizer(cfg.train)
    mesh = make_mesh(cfg)
    p_sh, dsh = param_shardings(cfg, mesh), data_sharding(cfg, mesh)
    params = jax.jit(lambda k: init_params(cfg, k), out_shardings=p_sh)(jax.random.key(0))
    state, st_sh = init_sharded_state(cfg, optimizer, mesh, params, p_sh, seed=0)
    del params
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch_size, seq + 1)).astype(np.int32)
    B, L = batch_size, seq
    batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
             "segment_ids": jnp.ones((B, L), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
             "loss_weights": jnp.ones((B, L), jnp.float32)}
    batch = jax.device_put(batch, dsh)
    t = time.perf_counter()
    with activate(cfg, mesh):
        compiled = make_train_step(cfg, optimizer, st_sh, dsh).lower(state, batch).compile()
    return cfg, mesh, compiled, state, batch, time.perf_counter() - t


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed c2jax steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="c2jax rounds; a peer run sits between two rounds")
    ap.add_argument("--warmup", type=int, default=3,
                    help="c2jax untimed steps after compile (the first steps grow the retained heap)")
    ap.add_argument("--peer-steps", type=int, default=3)
    ap.add_argument("--peer-warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="peer torch threads")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-malloc", choices=("retain", "default"), default="retain",
                    help="the peer's glibc malloc: 'retain' gives it c2jax's setting (c2jax.hostmem) through "
                         "GLIBC_TUNABLES, 'default' leaves glibc's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config overrides (e.g. model.capacity_factor=1.25)")
    ap.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before jax is imported")
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "train_step", "table.md"))
    ap.add_argument("--json", default="", help="also write the raw numbers here")
    return ap.parse_args(argv)


def run_peer(args):
    if not os.path.exists(REF_PY):
        return None, "peer not available (.venv-ref missing)"
    cmd = [REF_PY, HF_STEP, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.peer_steps),
           "--warmup", str(args.peer_warmup), "--threads", str(args.threads)]
    env = dict(os.environ)
    if args.peer_malloc == "retain":
        from c2jax.hostmem import glibc_tunables
        env["GLIBC_TUNABLES"] = glibc_tunables()
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return None, f"peer failed (rc {p.returncode}): {p.stderr.strip()[-500:]}"
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1]
    out = json.loads(line)
    out["wall_s"] = time.perf_counter() - t
    return out, " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from c2jax import hostmem
    hostmem.retain_freed_memory()  # first: host malloc keeps freed memory before XLA's threads start
    import jax

    from c2jax.models import param_count
    from c2jax.parallel import activate
    from c2jax.train.step import train_flops_per_token
    from c2jax.train.metrics import measured_matmul_peak

    peaks = [measured_matmul_peak()]
    cfg, mesh, compiled, state, batch, compile_s = build_step(args.batch, args.seq, args.set)
    counts = param_count(cfg)
    fpt = train_flops_per_token(cfg, args.seq)
    B, L = args.batch, args.seq
    losses = []
    for _ in range(args.warmup):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))

    ours_times, peer_runs, peer_note, dropped = [], [], "", []
    step_peaks = []   # [before, after] samples of each timed step

    def sample_peak():
        peaks.append(measured_matmul_peak(repeats=3))
        return peaks[-1]

    def ours_round():
        nonlocal state
        before = sample_peak()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(state)
            ours_times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
            dropped.append(float(metrics.get("dropped_fraction", 0.0)))
            after = sample_peak()
            step_peaks.append((before, after))
            before = after

    for r in range(args.rounds):
        ours_round()
        if r < args.rounds - 1 or args.rounds == 1:
            if args.no_peer:
                peer_note = "peer skipped (--no-peer)"
            else:
                peer, peer_note = run_peer(args)
                if peer is not None:
                    peer_runs.append(peer)
                    if peer["params"] != counts["total"]:
                        raise SystemExit(f"peer has {peer['params']:,} params, c2jax {counts['total']:,}")
    peak = max(peaks)
    tokens = B * L
    ours_step = statistics.median(ours_times)
    ours_tps = tokens / ours_step
    paired = [fpt * tokens / (t * max(p)) for t, p in zip(ours_times, step_peaks)]
    rows = [("c2jax (JAX/XLA)", ours_tps, ours_step, min(ours_times), fpt * ours_tps / peak,
             f"{100 * statistics.median(paired):.1f}% / {100 * max(paired):.1f}%")]
    peer_tps = peer_best = None
    if peer_runs:
        peer_times = [s for p in peer_runs for s in p["step_s"]]
        peer_step, peer_best = statistics.median(peer_times), min(peer_times)
        peer_tps = tokens / peer_step
        rows.append((f"HF peer ({peer_runs[0]['framework']}, {peer_runs[0]['threads']} threads)",
                     peer_tps, peer_step, peer_best, fpt * peer_tps / peak, "n/a"))
    load = os.getloadavg()[0]
    from c2jax.backends.cpu import kernels as cpu_kernels
    with activate(cfg, mesh):
        why = cpu_kernels.unavailable()
    kernels_note = "on (C2JAX_CPU_KERNELS=0 runs XLA's paths instead)" if why is None else f"off ({why})"
    cmd = "JAX_PLATFORMS=cpu .venv/bin/python experiments/bench/train_step.py " + " ".join(
        a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:]))
    lines = [
        f"# Train step: c2jax vs HF peer (89M Qwen3-MoE, f32, CPU, batch {B} x {L})", "",
        f"Command: `{cmd.strip()}`", "",
        "| impl | tokens/s (median step) | step ms: median / best | MFU strict (median / best) "
        "| MFU paired (median / best) | vs peer: median / best |",
        "|---|---|---|---|---|---|"]
    for name, tps, st, best, mfu, pair in rows:
        ratio = f"{tps / peer_tps:.2f}x / {peer_best / best:.2f}x" if peer_tps else "n/a"
        lines.append(f"| {name} | {tps:.0f} | {st * 1e3:.0f} / {best * 1e3:.0f} | {100 * mfu:.1f}% / "
                     f"{100 * mfu * st / best:.1f}% | {pair} | {ratio} |")
    lines += [
        "",
        f"- params {counts['total']:,} (peer {PEER_PARAMS:,}); FLOPs/token (training) {fpt / 1e6:.1f} M "
        f"(c2jax.models.flops_per_token, seq {L})",
        f"- matmul peak (measured_matmul_peak) samples, at the start and around every timed c2jax step: "
        f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)} GFLOP/s; strict MFU uses the best, "
        f"{peak / 1e9:.1f}; paired MFU per step: {', '.join(f'{100 * m:.0f}%' for m in paired)}",
        f"- c2jax step s: {', '.join(f'{x:.2f}' for x in ours_times)} (compile {compile_s:.1f} s); "
        f"dispatch {cfg.model.moe_dispatch}, capacity_factor {cfg.model.capacity_factor}, "
        f"max dropped fraction {max(dropped):.4f}",
        f"- peer step s: {', '.join(f'{x:.2f}' for p in peer_runs for x in p['step_s']) or peer_note}",
        f"- loss c2jax first/last {losses[0]:.4f} / {losses[-1]:.4f}"
        + (f"; peer {peer_runs[0]['loss_first']:.4f} / {peer_runs[-1]['loss_last']:.4f}" if peer_runs else ""),
        f"- devices: {jax.device_count()} (mesh {dict(mesh.shape)}); CPU training kernels "
        f"(c2jax.backends.cpu.kernels): {kernels_note}",
        f"- host malloc: c2jax {hostmem.state} (C2JAX_HOST_MALLOC=default leaves glibc's); "
        f"peer {'the same, through GLIBC_TUNABLES' if args.peer_malloc == 'retain' else 'glibc defaults'} "
        f"(--peer-malloc)",
        f"- XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`; extra overrides: {args.set or 'none'}; "
        f"load average (1m) at end {load:.1f} on {os.cpu_count()} CPUs (shared machine: compare ratios)",
    ]
    if not peer_runs:
        lines.append(f"- {peer_note}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ours_step_s": ours_times, "peer": peer_runs, "peaks": peaks, "step_peaks": step_peaks,
                       "paired_mfu": paired, "flops_per_token": fpt,
                       "compile_s": compile_s, "loadavg": load, "set": args.set,
                       "xla_flags": os.environ.get("XLA_FLAGS", "")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
