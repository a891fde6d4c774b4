"""Length penalty, effect on episodes (report section 3): RL with reward = verifier - coef * C(x)
for several penalty strengths, on the variable-length token toy (experiments/rl_toy.py;
x = 0.1 per generated token, k = 1, q = 0.5). Effect on episode (response) length and reward.
The C(x) curves themselves are experiments/length_penalty_curves.py.

The report's second effect, parallel tool calls (turns cost more than calls), needs multi-turn
agent episodes; the toy has one turn, so this script does not measure it (see the results page).

    JAX_PLATFORMS=cpu .venv/bin/python experiments/length_penalty.py [--parallel 2]
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

from rl_toy import load_metrics, md_table, run_sweep_parallel, smooth  # noqa: E402

SWEEP = os.path.join("configs", "sweeps", "length_penalty.py")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join("runs", "sweeps", "length_penalty"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "length_penalty"))
    ap.add_argument("--parallel", type=int, default=1)
    args = ap.parse_args(argv)
    sweep, _ = run_sweep_parallel(SWEEP, args.workdir, args.parallel)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from c2jax.sweep import expand
    os.makedirs(args.out, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rows = []
    for i, p in enumerate(expand(sweep)):
        train, evals = load_metrics(os.path.join(args.workdir, p.name))
        if not train:
            continue
        coef = p.overrides["rl.length_coef"]
        name = f"length_coef {coef:g}"
        steps = [r["step"] for r in train]
        for ax, key in zip(axes, ("reward/response_len", "reward/verifier", "reward")):
            ax.plot(steps, smooth([r.get(key, np.nan) for r in train]), color=f"C{i}", label=name)
        q = max(len(train) // 4, 1)
        m = lambda key, rs: float(np.nanmean([r.get(key, np.nan) for r in rs]))  # noqa: E731
        rows.append([coef, p.overrides["rl.length_q"], len(train), m("reward/response_len", train[:q]),
                     m("reward/response_len", train[-q:]), m("reward/truncated", train[-q:]),
                     m("reward/verifier", train[:q]), m("reward/verifier", train[-q:]),
                     m("reward/length_penalty", train[-q:]), evals[-1]["eval/pass_at_1"] if evals else None])
    for ax, t in zip(axes, ("response length (tokens, 5-step mean)", "verifier score", "total reward")):
        ax.set(xlabel="RL step", title=t)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "episode_effect.png"), dpi=110)
    cols = ["length_coef", "q", "steps", "length first 1/4", "length last 1/4", "truncated last 1/4",
            "verifier first 1/4", "verifier last 1/4", "penalty last 1/4", "held-out pass@1 end"]
    text = md_table(cols, rows)
    with open(os.path.join(args.out, "episode_effect.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
