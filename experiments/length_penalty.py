"""Length penalty, effect on episodes (report section 3): RL with reward = verifier - coef * C(x)
for several penalty strengths, on the variable-length token toy (experiments/rl_toy.py;
x = 0.1 per generated token, k = 1, q = 0.5). Effect on episode (response) length and reward.
The C(x) curves themselves are experiments/length_penalty_curves.py.

The report's second effect, parallel tool calls (turns cost more than calls), needs multi-turn
agent episodes; the toy has one turn, so this script does not measure it (see the results page).

    JAX_PLATFORMS=cpu .venv/bin/python experiments/length_penalty.py [--parallel N]
        [--workdir runs/sweeps/length_penalty] [--out experiments/results/length_penalty]

runs configs/sweeps/length_penalty.py and writes OUT/{episode_effect.png, episode_effect.md}.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from rl_toy import final_eval, md_table, mean_curve, quarter_means, run_sweep_parallel, seed_groups  # noqa: E402

SWEEP = os.path.join("configs", "sweeps", "length_penalty.py")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join("runs", "sweeps", "length_penalty"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "length_penalty"))
    ap.add_argument("--parallel", type=int, default=3, help="points run at once (launch lines)")
    args = ap.parse_args(argv)
    sweep, _ = run_sweep_parallel(SWEEP, args.workdir, args.parallel)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    groups = seed_groups(sweep, args.workdir, lambda ov: (ov["rl.length_coef"], ov["rl.length_q"]))
    rows = []
    for i, ((coef, q), runs) in enumerate(groups.items()):
        for ax, key in zip(axes, ("reward/response_len", "reward/verifier", "reward")):
            steps, ys = mean_curve(runs, key)
            ax.plot(steps, ys, color=f"C{i}", label=f"length_coef {coef:g} ({len(runs)} seeds)")
        rows.append([coef, q, len(runs), len(runs[0][0]), quarter_means(runs, "reward/response_len", False),
                     quarter_means(runs, "reward/response_len", True), quarter_means(runs, "reward/truncated", True),
                     quarter_means(runs, "reward/verifier", False), quarter_means(runs, "reward/verifier", True),
                     quarter_means(runs, "reward/length_penalty", True), final_eval(runs)])
    for ax, t in zip(axes, ("response length (tokens, 5-step mean, mean over seeds)", "verifier score",
                            "total reward")):
        ax.set(xlabel="RL step", title=t)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "episode_effect.png"), dpi=110)
    cols = ["length_coef", "q", "seeds", "steps", "length first 1/4", "length last 1/4", "truncated last 1/4",
            "verifier first 1/4", "verifier last 1/4", "penalty last 1/4", "held-out pass@1 end"]
    text = md_table(cols, rows)
    with open(os.path.join(args.out, "episode_effect.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
