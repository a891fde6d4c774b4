"""Render the RL learning runs (experiments/results/rl_harness/learning_runs.json) as a table.

    python experiments/rl_learning_table.py [--json FILE] [--out FILE]

One row per run: the held-out evaluation before RL and at each later evaluation (pass@1 and
best-of-K), and, where the run kept per-task pass rates, the paired rise of pass@1 over the
same tasks with its standard error (std of the per-task differences / sqrt(tasks)).
"""
from __future__ import annotations

import argparse
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "rl_harness", "learning_runs.json")


def _best(e: dict) -> tuple[str, float | None]:
    for k in sorted(e):
        if k.startswith("eval/best_of_"):
            return k.rsplit("_", 1)[1], e[k]
    return "", None


def paired_rise(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean per-task change of pass@1 and its standard error."""
    d = [a - b for a, b in zip(after, before)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, math.sqrt(var / n)


def render(data: dict) -> str:
    lines = ["# RL through the agent harness: held-out evaluations of the learning runs", "",
             f"Start: {data['init']}.", f"Command: `{data['command']}`.", "",
             "| run | held-out tasks | pass@1 (step: value) | best-of-K | paired rise of pass@1 |",
             "|---|---|---|---|---|"]
    for name, run in data["runs"].items():
        evals = run["evals"]
        k, _ = _best(evals[0])
        p1 = ", ".join(f"{e['step']}: {e['eval/pass_at_1']:.3f}" for e in evals)
        bk = ", ".join(f"{_best(e)[1]:.3f}" for e in evals)
        rise = ""
        if len(evals) > 1 and "eval/task_pass" in evals[0] and "eval/task_pass" in evals[-1]:
            m, se = paired_rise(evals[0]["eval/task_pass"], evals[-1]["eval/task_pass"])
            rise = f"{m:+.3f} +- {se:.3f}"
        lines.append(f"| {name} | {evals[0]['eval/tasks']} | {p1} | K={k}: {bk} | {rise} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(DEFAULT_JSON), "table.md"))
    args = ap.parse_args(argv)
    with open(args.json) as f:
        text = render(json.load(f))
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
