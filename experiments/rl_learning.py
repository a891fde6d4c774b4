"""Does RL improve the agent? Held-out pass@1 before and after an RL run from the demo's SFT model,
paired per task, with the step-by-step learning signal, written as one JSON record and a plot.

    python experiments/rl_learning.py                       # RL from runs/demo/sft (built if missing)
    python experiments/rl_learning.py --sft RUN --workdir runs/rl_learning [--append] \
        [--config configs/rl_tiny.py:learning] [--config.rl.steps=60 ...]

The settings are the config's (`configs/rl_tiny.py:learning` by default) plus any --config.*
overrides; the SFT model is `--sft`, or `runs/demo/sft`, or built by the demo's own stages
(c2jax.pipeline.build_sft_model) into WORKDIR/demo. Writes --out (default
experiments/results/rl_harness/learning.json): pass_at_1_before / _after, the paired change and
its standard error over tasks, tasks, attempts, the goal (+0.08 and 3 paired SE within 60 min of
RL: `rl_wall_s`, the RL steps and the evals after the first; the first eval measures the SFT model,
the same for every run from it, and is timed apart as `eval_before_s`) met or not, per-step train
pass rate, reward terms and group diagnostics (groups with equal rewards,
all passing, all failing; pass rate per suite), the KL to the reference, wall times and the exact
config; --append keeps the earlier runs of the file under "runs". The plot goes next to it
(learning.png). The record also sorts every training attempt by how it ended (passed; failed
after a tool error with no file changed; failed with files changed; other), per policy version,
and counts attempts that called an edit tool more than once (a retry) and how many of those passed.

    python experiments/rl_learning.py --from-run WORKDIR [--out ...]   # the record of a finished run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_CHANGE, GOAL_SE, GOAL_WALL_S = 0.08, 3.0, 3600.0
STEP_KEYS = ("reward", "pass_rate", "groups_zero_spread", "groups_all_pass", "groups_all_fail", "kl_ref_k1",
             "loss", "grad_norm", "batch_tokens", "learner_step_s", "learner_wait_s", "rows_skipped")


def sft_dir(args) -> str:
    """The SFT run to start from: --sft, runs/demo/sft, or the demo's stages built into WORKDIR/demo."""
    from c2jax.pipeline import sft_model
    if args.sft:
        path = args.sft
    elif os.path.exists(os.path.join(ROOT, "runs/demo/sft/summary.json")):
        path = os.path.join(ROOT, "runs/demo/sft")
    else:
        path = sft_model(os.path.join(args.workdir, "demo"))
    if not os.path.exists(os.path.join(path, "summary.json")):
        raise SystemExit(f"rl_learning: {path} is not a finished training run (no summary.json)")
    return path


def step_series(rows) -> dict:
    """Per-step lists of the learning-signal metrics and every reward term present."""
    steps = [r for r in rows if "reward" in r]
    keys = [k for k in STEP_KEYS if any(k in r for r in steps)]
    keys += sorted({k for r in steps for k in r if k.startswith(("reward/", "pass_rate/"))})
    return {"step": [int(r["step"]) for r in steps],
            **{k: [r.get(k) for r in steps] for k in keys}}


EDIT_TOOLS = ("edit_file", "write_file")


def attempt_outcomes(run_dir: str) -> dict:
    """Training attempts by how they ended, per policy version (the group's start_version), from
    the run's group store: passed, failed after a tool error with no file changed, failed with
    files changed, other; plus attempts with more than one edit-tool call and how many passed."""
    import zipfile
    from collections import defaultdict
    from c2jax.rl.store import GroupStore
    kinds = ("passed", "failed_tool_error_nothing_changed", "failed_changed_files", "failed_other")
    per_version = defaultdict(lambda: dict.fromkeys(kinds + ("repeated_edits", "repeated_edits_passed"), 0))
    skipped = 0
    store = GroupStore(os.path.join(run_dir, "groups"))
    for index in store.indices():
        try:
            g = store.get(index)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            skipped += 1
            continue
        trajs, passed, version = g.trajectories, g.passed, int(g.start_version)
        row = per_version[version]
        for t, ok in zip(trajs, passed):
            st = t.stats
            edits = sum(int(st.get("tool_calls_by_name", {}).get(k, 0)) for k in EDIT_TOOLS)
            if ok:
                kind = "passed"
            elif int(st.get("lines_changed", 0)) > 0:
                kind = "failed_changed_files"
            elif int(st.get("tool_errors", 0)) > 0:
                kind = "failed_tool_error_nothing_changed"
            else:
                kind = "failed_other"
            row[kind] += 1
            row["repeated_edits"] += edits > 1
            row["repeated_edits_passed"] += bool(edits > 1 and ok)
    versions = sorted(per_version)
    total = {k: sum(per_version[v][k] for v in versions) for k in per_version[versions[0]]} if versions else {}
    return {"total": total, "version": versions, **{k: [per_version[v][k] for v in versions] for k in total},
            "unreadable_group_files": skipped}


def held_out_curve(evals) -> list:
    """Held-out pass@1 at every eval of the run, each paired against the first (before RL)."""
    from c2jax.demo_report import paired_change
    first = evals[0]["eval/task_pass"]
    curve = []
    for ev in evals:
        c = paired_change(first, ev["eval/task_pass"])
        curve.append({"step": ev["step"], "pass_at_1": ev["eval/pass_at_1"], "se": ev["eval/pass_at_1_se"],
                      "change": c["change"], "paired_se": c["se"]})
    return curve


def wall_split(rows) -> dict:
    """Seconds from the run's first metrics row to the end of the held-out eval before RL
    (`eval_before_s`: it measures the SFT model, the same for every run from it), and from there to
    the end of the last eval (`rl_wall_s`: the RL steps and the evals after them)."""
    times = [r["time"] for r in rows if "time" in r]
    evals = [r["time"] for r in rows if "time" in r and "eval/pass_at_1" in r]
    if len(evals) < 2:
        return {"eval_before_s": None, "rl_wall_s": None}
    return {"eval_before_s": evals[0] - min(times), "rl_wall_s": evals[-1] - evals[0]}


def record(cfg, run_dir: str, summary: dict, sft: str, wall_s: float, argv) -> dict:
    from c2jax.train.metrics import read_metrics
    rows = read_metrics(run_dir)
    split = wall_split(rows)
    first, last = summary["evals"][0], summary["evals"][-1]
    before, after = first["eval/task_pass"], last["eval/task_pass"]
    curve = held_out_curve(summary["evals"])
    c = curve[-1]   # the last eval paired against the first
    ch = {"change": c["change"], "paired_se": c["paired_se"],
          "change_in_se": c["change"] / c["paired_se"] if c["paired_se"] else 0.0}
    k = int(cfg.rl.eval_k)
    if split["rl_wall_s"] is None:   # eval rows missing from metrics.jsonl: count the whole command
        split["rl_wall_s"] = wall_s
    met = ch["change"] >= GOAL_CHANGE and ch["change_in_se"] >= GOAL_SE and split["rl_wall_s"] <= GOAL_WALL_S
    sft = os.path.relpath(sft, ROOT) if sft.startswith(ROOT) else sft  # no machine paths in the record
    config = json.loads(cfg.to_json_best_effort())
    config["train"]["init_from"] = sft
    return {
        "date": datetime.date.today().isoformat(),
        "command": "python experiments/rl_learning.py " + " ".join(argv),
        "sft": sft,
        "pass_at_1_before": first["eval/pass_at_1"], "pass_at_1_after": last["eval/pass_at_1"],
        "pass_at_1_se_before": first["eval/pass_at_1_se"], "pass_at_1_se_after": last["eval/pass_at_1_se"],
        f"best_of_{k}_before": first.get(f"eval/best_of_{k}"), f"best_of_{k}_after": last.get(f"eval/best_of_{k}"),
        **ch, "tasks": len(before), "attempts": k, "rl_steps": int(summary.get("final_step", cfg.rl.steps)),
        "goal": {"change": GOAL_CHANGE, "paired_se": GOAL_SE, "wall_s": GOAL_WALL_S, "wall_counts": "rl_wall_s",
                 "met": bool(met)},
        "wall_s": wall_s, **split, "train_wall_s": summary.get("train_wall_s"),
        "per_step": step_series(rows),
        "attempt_outcomes": attempt_outcomes(run_dir),
        "held_out_curve": curve,
        "task_pass_before": before, "task_pass_after": after,
        "config": config,
    }


def record_of_run(run_dir: str, argv) -> dict:
    """The record of a finished run directory; its wall time is the first to the last metrics row
    (the run's own time, without this script's start-up)."""
    import ml_collections
    from c2jax.train.metrics import read_metrics
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            cfg = ml_collections.ConfigDict(json.load(f))
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"rl_learning: {run_dir} is not a finished RL run: {e}") from None
    if len(summary.get("evals", [])) < 2:
        raise SystemExit(f"rl_learning: {run_dir} has {len(summary.get('evals', []))} held-out evals; needs the "
                         "first and the last")
    times = [r["time"] for r in read_metrics(run_dir) if "time" in r]
    return record(cfg, run_dir, summary, cfg.train.init_from, (max(times) - min(times)) if times else 0.0, argv)


def plot(rec: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = rec["per_step"]
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(16, 4))
    for k in ("pass_rate", "groups_zero_spread", "groups_all_fail", "groups_all_pass"):
        if k in s:
            a.plot(s["step"], s[k], marker=".", label=k)
    a.set_xlabel("RL step")
    a.set_title("training groups")
    a.legend(fontsize=8)
    o = rec.get("attempt_outcomes") or {}
    if o.get("version"):
        n = [sum(o[k][i] for k in ("passed", "failed_tool_error_nothing_changed", "failed_changed_files",
                                   "failed_other")) or 1 for i in range(len(o["version"]))]
        for k in ("passed", "failed_tool_error_nothing_changed", "failed_changed_files", "repeated_edits"):
            c.plot(o["version"], [v / t for v, t in zip(o[k], n)], marker=".", label=k)
        c.set_xlabel("policy version (rollout start)")
        c.set_title("training attempts by outcome (fraction)")
        c.legend(fontsize=8)
    curve = rec.get("held_out_curve") or [
        {"step": 0, "pass_at_1": rec["pass_at_1_before"], "se": rec["pass_at_1_se_before"]},
        {"step": rec["rl_steps"], "pass_at_1": rec["pass_at_1_after"], "se": rec["pass_at_1_se_after"]}]
    b.errorbar([p["step"] for p in curve], [p["pass_at_1"] for p in curve], yerr=[p["se"] for p in curve],
               marker="o", capsize=4)
    b.set_xlabel("RL step")
    b.set_title(f"held-out pass@1, {rec['tasks']} tasks x {rec['attempts']}: "
                f"{rec['change']:+.3f} +- {rec['paired_se']:.3f} (paired SE)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/rl_tiny.py:learning")
    ap.add_argument("--sft", default="")
    ap.add_argument("--workdir", default="runs/rl_learning")
    ap.add_argument("--out", default="experiments/results/rl_harness/learning.json")
    ap.add_argument("--append", action="store_true", help="keep the runs already in --out")
    ap.add_argument("--from-run", default="", help="write the record of a finished run (its config.json, "
                    "summary.json, metrics.jsonl, groups/) instead of running one")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        ap.error(f"unknown arguments {bad} (config overrides are --config.section.key=value)")
    os.chdir(ROOT)   # configs and the default paths are relative to the checkout
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import load_config
    if args.from_run:
        rec = record_of_run(args.from_run, argv)
    else:
        from c2jax.rl.loop import run_rl
        sft = sft_dir(args)
        cfg = load_config(args.config, [f"--config.train.init_from={sft}", *overrides])
        if int(cfg.rl.eval_every) < 0:
            raise SystemExit("rl_learning: needs the held-out evals before and after (rl.eval_every >= 0)")
        if os.path.exists(os.path.join(args.workdir, "metrics.jsonl")):
            raise SystemExit(f"rl_learning: {args.workdir} already holds a run; pass a fresh --workdir")
        t0 = time.time()
        summary = run_rl(cfg, args.workdir)
        rec = record(cfg, args.workdir, summary, sft, time.time() - t0, argv)
    previous = []
    if args.append and os.path.exists(args.out):
        old = json.load(open(args.out))
        previous = old.pop("runs", []) + [old]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**rec, "runs": previous}, f, indent=1)
    plot(rec, os.path.splitext(args.out)[0] + ".png")
    print(f"held-out pass@1 {rec['pass_at_1_before']:.3f} -> {rec['pass_at_1_after']:.3f}: "
          f"{rec['change']:+.3f} +- {rec['paired_se']:.3f} ({rec['change_in_se']:.1f} paired SE, {rec['tasks']} tasks "
          f"x {rec['attempts']}); RL and its evals {rec['rl_wall_s'] / 60:.1f} min (the whole "
          f"command {rec['wall_s'] / 60:.1f} min); goal (+{GOAL_CHANGE}, {GOAL_SE:.0f} SE, "
          f"{GOAL_WALL_S / 60:.0f} min) {'met' if rec['goal']['met'] else 'NOT met'}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
