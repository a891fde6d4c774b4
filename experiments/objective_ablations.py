"""Objective ablations (report section 3, Dr. GRPO): the report's objective (advantage = reward -
group mean, constant normalizer, overlong rollouts kept) vs each switch flipped alone: GRPO's
division by the group std, GRPO's per-sequence 1/length normalizer, masking truncated rollouts.
Effect on reward and response length, on the variable-length token toy (experiments/rl_toy.py).

    JAX_PLATFORMS=cpu .venv/bin/python experiments/objective_ablations.py [--parallel N]
        [--workdir runs/sweeps/objective_ablations] [--out experiments/results/objective_ablations]

runs configs/sweeps/objective_ablations.py (points already DONE are reused) and writes
OUT/{objective_ablations.png, table.md}.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from rl_toy import final_eval, md_table, mean_curve, quarter_means, run_sweep_parallel, seed_groups  # noqa: E402

SWEEP = os.path.join("configs", "sweeps", "objective_ablations.py")


def label(ov):
    flips = []
    if ov.get("rl.std_normalize"):
        flips.append("std-normalized")
    if ov.get("rl.normalizer") != "constant":
        flips.append(f"1/length ({ov.get('rl.normalizer')})")
    if ov.get("rl.mask_overlong"):
        flips.append("overlong masked")
    return "report (Dr. GRPO)" if not flips else " + ".join(flips)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join("runs", "sweeps", "objective_ablations"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "objective_ablations"))
    ap.add_argument("--parallel", type=int, default=4, help="points run at once (launch lines)")
    args = ap.parse_args(argv)
    sweep, table = run_sweep_parallel(SWEEP, args.workdir, args.parallel)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    os.makedirs(args.out, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    groups = seed_groups(sweep, args.workdir, label)
    rows = []
    for i, (name, runs) in enumerate(groups.items()):
        for ax, key in zip(axes, ("reward", "reward/response_len", "reward/truncated")):
            steps, ys = mean_curve(runs, key)
            ax.plot(steps, ys, color=f"C{i}", label=f"{name} ({len(runs)} seeds)")
        rows.append([name, len(runs), len(runs[0][0]), quarter_means(runs, "reward", False),
                     quarter_means(runs, "reward", True), quarter_means(runs, "reward/response_len", False),
                     quarter_means(runs, "reward/response_len", True), quarter_means(runs, "reward/truncated", True),
                     float(np.mean([e[0]["eval/pass_at_1"] for _, e in runs if e])), final_eval(runs)])
    for ax, t in zip(axes, ("training reward (5-step mean, mean over seeds)", "response length (tokens)",
                            "fraction truncated")):
        ax.set(xlabel="RL step", title=t)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "objective_ablations.png"), dpi=110)
    cols = ["objective", "seeds", "steps", "reward first 1/4", "reward last 1/4", "length first 1/4", "length last 1/4",
            "truncated last 1/4", "held-out pass@1 start", "held-out pass@1 end"]
    text = md_table(cols, rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
