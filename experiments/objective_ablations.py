"""Objective ablations (report section 3, Dr. GRPO): the report's objective (advantage = reward -
group mean, constant normalizer, overlong rollouts kept) vs each switch flipped alone: GRPO's
division by the group std, GRPO's per-sequence 1/length normalizer, masking truncated rollouts.
Effect on reward and response length, on the variable-length token toy (experiments/rl_toy.py).

    JAX_PLATFORMS=cpu .venv/bin/python experiments/objective_ablations.py [--parallel 2]
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

from rl_toy import load_metrics, md_table, run_sweep_parallel, smooth  # noqa: E402

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
    ap.add_argument("--parallel", type=int, default=1)
    args = ap.parse_args(argv)
    sweep, table = run_sweep_parallel(SWEEP, args.workdir, args.parallel)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    os.makedirs(args.out, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rows = []
    from c2jax.sweep import expand
    for i, p in enumerate(expand(sweep)):
        train, evals = load_metrics(os.path.join(args.workdir, p.name))
        if not train:
            continue
        name = label(p.overrides) + (f" seed {p.overrides['seed']}" if len(sweep.seeds) > 1 else "")
        steps = [r["step"] for r in train]
        for ax, key in zip(axes, ("reward", "reward/response_len", "reward/truncated")):
            ax.plot(steps, smooth([r.get(key, np.nan) for r in train]), color=f"C{i}", label=name)
        q = max(len(train) // 4, 1)
        m = lambda key, rs: float(np.nanmean([r.get(key, np.nan) for r in rs]))  # noqa: E731
        rows.append([name, len(train), m("reward", train[:q]), m("reward", train[-q:]),
                     m("reward/response_len", train[:q]), m("reward/response_len", train[-q:]),
                     m("reward/truncated", train[-q:]), evals[0]["eval/pass_at_1"] if evals else None,
                     evals[-1]["eval/pass_at_1"] if evals else None])
    for ax, t in zip(axes, ("training reward (5-step mean)", "response length (tokens)", "fraction truncated")):
        ax.set(xlabel="RL step", title=t)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "objective_ablations.png"), dpi=110)
    cols = ["objective", "steps", "reward first 1/4", "reward last 1/4", "length first 1/4", "length last 1/4",
            "truncated last 1/4", "held-out pass@1 start", "held-out pass@1 end"]
    text = md_table(cols, rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
