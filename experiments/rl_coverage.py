"""RL coverage (report Fig. 5): held-out mean pass@1 and best-of-K every few RL steps; the report
finds both rise throughout RL (RL widens coverage rather than only sharpening pass@1). Runs on
the variable-length token toy (experiments/rl_toy.py) with the report's objective, over seeds
(the seed-0 run is reused from the objective_ablations sweep when it has finished there).

    JAX_PLATFORMS=cpu .venv/bin/python experiments/rl_coverage.py [--parallel N]
        [--workdir runs/sweeps/rl_coverage] [--out experiments/results/rl_coverage]

runs configs/sweeps/rl_coverage.py and writes OUT/{rl_coverage.png, table.md}.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from rl_toy import load_metrics, md_table, run_sweep_parallel  # noqa: E402

SWEEP = os.path.join("configs", "sweeps", "rl_coverage.py")


def reuse_points(sweep_path, workdir, other):
    """Copy points of `other` (a sweep workdir) that are DONE and have this sweep's point names."""
    import shutil

    from c2jax.sweep import DONE, expand, load_sweep
    for p in expand(load_sweep(sweep_path)):
        src, dst = os.path.join(other, p.name), os.path.join(workdir, p.name)
        if os.path.exists(os.path.join(src, DONE)) and not os.path.exists(os.path.join(dst, DONE)):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "groups"))
            print(f"reused {src}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join("runs", "sweeps", "rl_coverage"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "rl_coverage"))
    ap.add_argument("--parallel", type=int, default=3, help="points run at once (launch lines)")
    ap.add_argument("--reuse", default=os.path.join("runs", "sweeps", "objective_ablations"),
                    help="a sweep workdir whose finished points with the same name are copied, not rerun")
    args = ap.parse_args(argv)
    reuse_points(SWEEP, args.workdir, args.reuse)
    sweep, _ = run_sweep_parallel(SWEEP, args.workdir, args.parallel)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from c2jax.sweep import expand
    os.makedirs(args.out, exist_ok=True)
    curves = {}
    k = None
    for p in expand(sweep):
        _, evals = load_metrics(os.path.join(args.workdir, p.name))
        for e in evals:
            bk = [key for key in e if key.startswith("eval/best_of_")]
            k = int(bk[0].rsplit("_", 1)[1]) if bk else k
            curves.setdefault(int(e["step"]), []).append((e["eval/pass_at_1"], e[bk[0]] if bk else np.nan))
    steps = sorted(curves)
    mean = lambda i: np.array([np.mean([v[i] for v in curves[s]]) for s in steps])  # noqa: E731
    lo = lambda i: np.array([np.min([v[i] for v in curves[s]]) for s in steps])  # noqa: E731
    hi = lambda i: np.array([np.max([v[i] for v in curves[s]]) for s in steps])  # noqa: E731
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, c) in enumerate((("mean pass@1", "C0"), (f"best-of-{k}", "C1"))):
        ax.plot(steps, mean(i), "o-", color=c, label=name)
        ax.fill_between(steps, lo(i), hi(i), color=c, alpha=0.2)
    n_seeds = max(len(v) for v in curves.values()) if curves else 0
    ax.set(xlabel="RL step", ylabel="held-out success", ylim=(0, 1.02),
           title=f"RL coverage on the length toy ({n_seeds} seeds, band = min..max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "rl_coverage.png"), dpi=110)
    rows = [[s, len(curves[s]), float(mean(0)[j]), float(lo(0)[j]), float(hi(0)[j]), float(mean(1)[j])]
            for j, s in enumerate(steps)]
    text = md_table(["RL step", "seeds", "mean pass@1", "min", "max", f"best-of-{k}"], rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
