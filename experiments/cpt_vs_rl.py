"""CPT budget vs RL reward (report section 2, Fig. 2): three log-spaced CPT budgets of the tiny
model, each followed by the same SFT and the same RL run; post-SFT codebase loss vs RL reward.

    JAX_PLATFORMS=cpu .venv/bin/python experiments/cpt_vs_rl.py [--parallel N] [--workdir runs/sweeps/cpt_vs_rl]
        [--out experiments/results/cpt_vs_rl]

runs the sweep configs/sweeps/cpt_vs_rl.py (points = CPT steps), then writes OUT/{cpt_vs_rl.png,
table.md}. Each sweep point runs this file as its command:

    python experiments/cpt_vs_rl.py --config configs/stages/cpt.py:tiny --config.train.steps=N --workdir DIR

  1. CPT   c2jax.train.loop.run_training(cfg, DIR/cpt) on the stdlib corpus (budget = train.steps);
  2. SFT   the same for every point: SFT_STEPS steps on oracle read-then-fix transcripts of
           synthetic train tasks (written once into WORKDIR/shared with the shared tokenizer);
           post-SFT codebase loss = the SFT run's final held-out codebase loss;
  3. RL    the same for every point: configs/rl_tiny.py from the SFT run, RL_OVERRIDES
           (harness env, synthetic:1 tasks, Dr. GRPO); RL reward = mean training reward over its
           steps; held-out pass@1 / best-of-K before and after RL.
  -> DIR/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from rl_toy import enable_compile_cache, load_metrics, md_table, parse, run_sweep_parallel  # noqa: E402

SWEEP = os.path.join("configs", "sweeps", "cpt_vs_rl.py")
SFT_OVERRIDES = ["--config.train.seq_len=1024", "--config.train.batch_size=4", "--config.train.steps=30",
                 "--config.train.lr=2e-3", "--config.train.eval_every=0", "--config.train.warmup_steps=3",
                 "--config.train.checkpoint_every=30", "--config.train.log_every=5"]
RL_OVERRIDES = ["--config.rl.steps=4", "--config.rl.prompts_per_step=2", "--config.rl.group_size=4",
                "--config.rl.eval_every=0", "--config.rl.eval_tasks=8", "--config.rl.eval_k=2",
                "--config.rl.checkpoint_every=4", "--config.rl.log_delta=False"]
N_TRANSCRIPT_TASKS = 128


def shared_dir(point_dir: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(point_dir)), "shared")


def prepare_shared(shared: str, cpt_spec: str = "configs/stages/cpt.py:tiny") -> dict:
    """The tokenizer every point uses and the SFT transcripts (oracle episodes) in its ids."""
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    from c2jax.data.pipeline import load_corpus_and_tokenizer
    from c2jax.pipeline import write_oracle_transcripts
    os.makedirs(shared, exist_ok=True)
    path = os.path.join(shared, "sft_transcripts.jsonl")
    stats_path = os.path.join(shared, "transcripts.json")
    if os.path.exists(stats_path):
        with open(stats_path) as f:
            return json.load(f)
    cfg = load_config(cpt_spec)
    _, tok = load_corpus_and_tokenizer(cfg.data, shared)
    stats = write_oracle_transcripts(tok, path, n_per_suite=N_TRANSCRIPT_TASKS, max_tokens=1024)
    with open(stats_path, "w") as f:
        json.dump(stats, f)
    return stats


def run_point(spec: str, workdir: str, overrides: list[str]) -> int:
    import numpy as np
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    from c2jax.rl.loop import run_rl
    from c2jax.train.loop import run_training
    shared = shared_dir(workdir)
    prepare_shared(shared, spec)
    os.makedirs(workdir, exist_ok=True)
    tok_over = [f"--config.data.tokenizer_path={shared}"]
    cpt_dir, sft_dir, rl_dir = (os.path.join(workdir, s) for s in ("cpt", "sft", "rl"))
    cpt_cfg = load_config(spec, overrides + tok_over)
    cpt = _cached(cpt_dir, lambda: run_training(cpt_cfg, cpt_dir))
    sft_cfg = load_config("configs/stages/sft.py:tiny", [
        f"--config.train.init_from={cpt_dir}", f"--config.data.sft_path={os.path.join(shared, 'sft_transcripts.jsonl')}",
        *tok_over, *SFT_OVERRIDES])
    sft_cfg.train.stage = "sft"
    sft = _cached(sft_dir, lambda: run_training(sft_cfg, sft_dir))
    rl_cfg = load_config("configs/rl_tiny.py", [f"--config.train.init_from={sft_dir}", *RL_OVERRIDES])
    rl = _cached(rl_dir, lambda: run_rl(rl_cfg, rl_dir))
    train, _ = load_metrics(rl_dir)
    evals = rl.get("evals", [])
    out = {"cpt_steps": int(cpt_cfg.train.steps),
           "cpt_tokens": int(cpt_cfg.train.steps) * cpt_cfg.train.batch_size * cpt_cfg.train.seq_len,
           "cpt_codebase_loss": cpt["final_eval"].get("codebase_loss"),
           "post_sft_codebase_loss": sft["final_eval"].get("codebase_loss"),
           "post_sft_heldout_loss": sft["final_eval"].get("heldout_loss"),
           "rl_reward_mean": float(np.mean([r["reward"] for r in train])) if train else None,
           "rl_verifier_mean": float(np.mean([r.get("reward/verifier", np.nan) for r in train])) if train else None,
           "rl_pass_rate_mean": float(np.mean([r["pass_rate"] for r in train])) if train else None,
           "pre_rl_pass_at_1": evals[0]["eval/pass_at_1"] if evals else None,
           "post_rl_pass_at_1": evals[-1]["eval/pass_at_1"] if evals else None,
           "post_rl_best_of_k": next((v for k, v in evals[-1].items() if k.startswith("eval/best_of_")), None)
           if evals else None}
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0


def _cached(d, fn):
    p = os.path.join(d, "summary.json")
    if os.path.exists(p):
        with open(p) as f:
            return json.load(f)
    return fn()


def report(table, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    cols = table.columns
    rows = [dict(zip(cols, r)) for r in table.rows if dict(zip(cols, r))["status"] == "done"]
    rows.sort(key=lambda r: r["cpt_steps"])
    os.makedirs(out, exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["cpt_tokens"] for r in rows]
    a1.plot(x, [r["post_sft_codebase_loss"] for r in rows], "o-", label="post-SFT codebase loss")
    a1.plot(x, [r["cpt_codebase_loss"] for r in rows], "s--", label="post-CPT codebase loss")
    a1.set(xscale="log", xlabel="CPT tokens", ylabel="held-out codebase loss", title="CPT budget -> loss")
    a1.legend(fontsize=8)
    for key, lab in (("rl_reward_mean", "mean RL reward"), ("post_rl_pass_at_1", "held-out pass@1 after RL")):
        a2.plot([r["post_sft_codebase_loss"] for r in rows], [r[key] for r in rows], "o-", label=lab)
    for r in rows:
        a2.annotate(f"{r['cpt_steps']} CPT steps", (r["post_sft_codebase_loss"], r["rl_reward_mean"]), fontsize=7)
    a2.set(xlabel="post-SFT codebase loss", ylabel="RL reward / pass@1", title="post-SFT loss vs RL reward")
    a2.invert_xaxis()
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cpt_vs_rl.png"), dpi=110)
    keys = ["cpt_steps", "cpt_tokens", "cpt_codebase_loss", "post_sft_codebase_loss", "rl_reward_mean",
            "rl_verifier_mean", "rl_pass_rate_mean", "pre_rl_pass_at_1", "post_rl_pass_at_1", "post_rl_best_of_k"]
    lines = [md_table(keys, [[r.get(k) for k in keys] for r in rows])]
    if len(rows) >= 3:
        lx = np.array([r["post_sft_codebase_loss"] for r in rows])
        ry = np.array([r["rl_reward_mean"] for r in rows])
        lines += ["", f"Spearman-style check: order of post-SFT loss (low->high) gives RL reward "
                  f"{[round(float(v), 4) for v in ry[np.argsort(lx)]]}"]
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if any(a.startswith("--config") for a in argv):  # one sweep point
        enable_compile_cache()
        spec, workdir, overrides = parse(argv)
        return run_point(spec, workdir, overrides)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join("runs", "sweeps", "cpt_vs_rl"))
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "cpt_vs_rl"))
    ap.add_argument("--parallel", type=int, default=3, help="points run at once (launch lines)")
    args = ap.parse_args(argv)
    print("shared tokenizer + transcripts:", prepare_shared(os.path.join(args.workdir, "shared")), flush=True)
    _, table = run_sweep_parallel(SWEEP, args.workdir, args.parallel)
    report(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
