"""The demo's report: workdir/report.md and report.json (the same figures) plus PNG plots, built
from what the demo's runs already wrote (summary.json, metrics.jsonl, eval_*/report.json)."""
from __future__ import annotations

import json
import math
import os

import numpy as np

PLOTS = {"loss": "loss.png", "rl": "rl_reward.png", "pass_at_1": "pass_at_1.png"}


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _curve(rows, key):
    # A rerun into the same workdir appends to metrics.jsonl: the last value of each step counts.
    pts = dict(sorted((r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))))
    return list(pts), list(pts.values())


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def task_pass(eval_report: dict) -> tuple[str, list]:
    """(suite, per-task pass fraction over attempts) of a benchmark report with one suite."""
    suite = next(iter(eval_report["tasks"]))
    return suite, [float(np.mean(t["passed"])) for t in eval_report["tasks"][suite]]


def pass_at_1(per_task) -> dict:
    """pass@1 (mean of per-task pass fractions) and its standard error over tasks."""
    x = np.asarray(per_task, float)
    se = float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")
    return {"pass_at_1": float(x.mean()), "se": _num(se)}


def paired_change(before, after) -> dict:
    """after - before on the same tasks: mean per-task change, its paired standard error, and
    whether it is within noise (|change| < 2 SE)."""
    d = np.asarray(after, float) - np.asarray(before, float)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    change = float(d.mean())
    within = not math.isfinite(se) or change == 0.0 or abs(change) < 2 * se
    in_se = change / se if math.isfinite(se) and se > 0 else None
    return {"change": change, "se": _num(se), "change_in_se": in_se, "tasks": len(d), "within_noise": bool(within)}


def _stage_figures(summary, rows):
    if summary is None:
        return None
    first, last = summary.get("initial_eval") or {}, summary.get("final_eval") or {}
    steps, loss = _curve(rows, "loss")
    return {"steps": summary.get("final_step"),
            "heldout_loss_first": _num(first.get("heldout_loss")), "heldout_loss_last": _num(last.get("heldout_loss")),
            "codebase_ppl_first": _num(first.get("codebase_ppl")), "codebase_ppl_last": _num(last.get("codebase_ppl")),
            "train_loss_first": _num(loss[0]) if loss else None, "train_loss_last": _num(loss[-1]) if loss else None}


def _rl_figures(rl_dir):
    rows = _metrics(rl_dir)
    _, rew = _curve(rows, "reward")
    _, pas = _curve(rows, "pass_rate")
    if not rew:
        return None
    k = max(1, len(rew) // 4)  # first and last quarter of the steps: single steps are noisy
    return {"steps": len(rew), "steps_averaged": k,
            "reward_first": float(np.mean(rew[:k])), "reward_last": float(np.mean(rew[-k:])),
            "train_pass_rate_first": _num(float(np.mean(pas[:k]))),
            "train_pass_rate_last": _num(float(np.mean(pas[-k:])))}


def _eval_figures(eval_report):
    suite, per_task = task_pass(eval_report)
    s = eval_report["suites"][suite]
    pk = s.get("pass_at_k") or {}
    kmax = max(pk, key=int) if pk else None
    return {"suite": suite, "tasks": s["tasks"], "passes": s["passes"], **pass_at_1(per_task),
            "best_of_k": _num(pk[kmax]) if kmax else None, "k": int(kmax) if kmax else None,
            "completion_tokens": _num(s.get("completion_tokens_per_task")),
            "malformed_call_rate": _num(s.get("malformed_call_rate"))}, per_task


def build_report(workdir: str, info: dict) -> dict:
    """report.json's content: `info` (mode, sizes, commands, wall_s, transcripts, temperature)
    plus the figures read from the demo's run directories under workdir."""
    d = {k: os.path.join(workdir, k) for k in ("cpt", "sft", "rl", "eval_sft", "eval_rl")}
    rep = {**info, "workdir": workdir}
    rep["cpt"] = _stage_figures(_read_json(os.path.join(d["cpt"], "summary.json")), _metrics(d["cpt"]))
    rep["sft"] = _stage_figures(_read_json(os.path.join(d["sft"], "summary.json")), _metrics(d["sft"]))
    rep["rl"] = _rl_figures(d["rl"])
    evals, per_task = {}, {}
    for name in ("sft", "rl"):
        r = _read_json(os.path.join(d[f"eval_{name}"], "report.json"))
        if r is not None:
            evals[name], per_task[name] = _eval_figures(r)
    rep["heldout"] = evals
    if "sft" in per_task and "rl" in per_task and len(per_task["sft"]) == len(per_task["rl"]):
        rep["rl_change"] = paired_change(per_task["sft"], per_task["rl"])
    rep["paths"] = {
        "checkpoints": {k: os.path.join(d[k], "checkpoints") for k in ("cpt", "sft", "rl")
                        if os.path.isdir(os.path.join(d[k], "checkpoints"))},
        "tensorboard": {k: os.path.join(d[k], "tb") for k in ("cpt", "sft", "rl") if os.path.isdir(os.path.join(d[k], "tb"))},
        "eval_reports": {k: os.path.join(d[f"eval_{k}"], "report.md") for k in evals}}
    rep["plots"] = {k: v for k, v in PLOTS.items()}
    rep["rl_summary_line"] = rl_sentence(rep)
    return rep


def rl_sentence(rep: dict) -> str:
    """One honest sentence on what RL did to held-out pass@1."""
    c = rep.get("rl_change")
    if not c:
        return "RL: no before/after held-out evaluation to compare."
    ev = rep["heldout"]
    base = (f"held-out pass@1 {ev['sft']['pass_at_1']:.3f} after SFT -> {ev['rl']['pass_at_1']:.3f} after RL: "
            f"change {c['change']:+.3f} +- {c['se']:.3f} (paired standard error over {c['tasks']} tasks)")
    if c["within_noise"]:
        return f"RL: {base}; within noise (|change| < 2 standard errors): this run shows no measurable effect of RL."
    size = "" if c.get("change_in_se") is None else f" ({c['change_in_se']:+.1f} standard errors)"
    return f"RL: {base}; a {'rise' if c['change'] > 0 else 'drop'}{size}, more than 2 standard errors: beyond noise."


def _paths(d: dict) -> str:
    return ", ".join(f"`{v}`" for v in d.values()) or "none"


def _f(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)


def render_markdown(rep: dict) -> str:
    """report.md: what ran, the figures, where things are, what to try next."""
    s, w = rep.get("sizes", {}), rep.get("wall_s", {})
    cmd = "python -m c2jax demo --workdir " + rep["workdir"] + {"quick": " --quick", "full": " --full"}.get(
        rep.get("mode"), "")
    out = ["# c2jax demo report", "",
           f"`{cmd}` ({rep.get('mode')} setting): continued pretraining -> oracle transcripts -> SFT -> RL -> "
           f"held-out evaluation of the tiny MoE model. Total wall time {_f(w.get('total'), '{:.0f}')} s.", "",
           "## What ran", "", "| stage | size | wall time (s) | command |", "|---|---|---|---|"]
    t = rep.get("transcripts") or {}
    cmds, shape = rep.get("commands", {}), rep.get("rl_shape") or {}
    rows = [("CPT", f"{_f((rep.get('cpt') or {}).get('steps'), '{:.0f}')} steps (configs/stages/cpt.py:tiny)",
             "cpt", cmds.get("cpt", "")),
            ("oracle transcripts", f"{s.get('transcripts')} train tasks, {t.get('kept')} kept", "transcripts",
             "c2jax.pipeline.write_oracle_transcripts"),
            ("SFT", f"{s.get('sft_steps')} steps x 8 rows x 768 tokens", "sft", cmds.get("sft", "")),
            ("RL", f"{s.get('rl_steps')} steps x {shape.get('prompts_per_step', '?')} prompts x "
                   f"{shape.get('group_size', '?')} attempts ({shape.get('config', s.get('rl_config'))})", "rl",
             cmds.get("rl", "")),
            ("held-out eval", f"{s.get('eval_tasks')} tasks x {s.get('eval_passes')} attempts, SFT and RL models, "
             f"temperature {rep.get('temperature')}{_episode_limits(rep.get('eval_episode'))}", "eval",
             "c2jax.pipeline.evaluate_run")]
    for name, size, key, c in rows:
        out.append(f"| {name} | {size} | {_f(w.get(key), '{:.0f}')} | {'`' + c + '`' if c else ''} |")
    out += ["", "## Figures", "", "| stage | held-out loss (first -> last) | codebase perplexity | train loss (first -> last) |",
            "|---|---|---|---|"]
    for name in ("cpt", "sft"):
        f = rep.get(name)
        if f:
            out.append(f"| {name.upper()} | {_f(f['heldout_loss_first'])} -> {_f(f['heldout_loss_last'])} | "
                       f"{_f(f['codebase_ppl_first'], '{:.1f}')} -> {_f(f['codebase_ppl_last'], '{:.1f}')} | "
                       f"{_f(f['train_loss_first'])} -> {_f(f['train_loss_last'])} |")
    out += ["", "Held-out loss and codebase perplexity are on the code corpus: SFT on agent transcripts trades "
                "them for the transcripts' format (SFT's train loss is on the transcripts' model tokens)."]
    rl = rep.get("rl")
    if rl:
        out += ["", f"RL training rollouts (mean of the first and last {rl['steps_averaged']} of {rl['steps']} steps): "
                    f"reward {_f(rl['reward_first'])} -> {_f(rl['reward_last'])}, pass rate "
                    f"{_f(rl['train_pass_rate_first'])} -> {_f(rl['train_pass_rate_last'])}."]
    ev = rep.get("heldout") or {}
    if ev:
        out += ["", "| model | suite | pass@1 +- SE | best-of-K | completion tokens | malformed calls |",
                "|---|---|---|---|---|---|"]
        for name, label in (("sft", "CPT -> SFT"), ("rl", "CPT -> SFT -> RL")):
            e = ev.get(name)
            if e:
                out.append(f"| {label} | {e['suite']} | {_f(e['pass_at_1'])} +- {_f(e['se'])} | "
                           f"{_f(e['best_of_k'])} (K={e['k']}) | {_f(e['completion_tokens'], '{:.0f}')} | "
                           f"{_f(e['malformed_call_rate'])} |")
        out += ["", rep["rl_summary_line"], "",
                "SE: standard error over tasks of each task's pass fraction. The change is paired (the same "
                "held-out tasks and sampling seeds before and after RL)."]
    out += ["", "## Plots", ""]
    out += [f"![{k}]({v})" for k, v in rep["plots"].items()]
    p = rep["paths"]
    out += ["", "## Where things are", "",
            "- checkpoints (orbax): " + _paths(p["checkpoints"]),
            "- TensorBoard: `tensorboard --logdir " + rep["workdir"] + "` (event files in " + _paths(p["tensorboard"]) + ")",
            "- per-run metrics: `metrics.jsonl` and `summary.json` in each run directory",
            "- evaluation reports: " + _paths(p["eval_reports"]),
            "", "## What to try next", ""]
    if rep.get("mode") != "full":
        out.append(f"- the longer setting: `python -m c2jax demo --full --workdir {rep['workdir']}_full` (the RL "
                   "recipe of configs/rl_tiny.py:learning, 24 prompts x 8 for 44 steps, and 128 held-out tasks x 4; "
                   "about 67 minutes on 2 CPU cores)")
    out += ["- the learning goal's command from this SFT model: `python experiments/rl_learning.py --sft "
            f"{os.path.join(rep['workdir'], 'sft')} --workdir runs/rl_learning` (RL, then pass@1 before and after on "
            "128 held-out tasks x 4, into experiments/results/rl_harness/learning.json)",
            "- a bigger model or other stage settings: `configs/tiny.py`, `configs/stages/cpt.py`, "
            "`configs/stages/sft.py`, `configs/rl_tiny.py` (any key can be overridden with `--config.KEY=VALUE`)",
            "- sizes of each demo setting: `DEMO_SIZES` in `c2jax/pipeline.py`"]
    return "\n".join(out) + "\n"


def write_plots(workdir: str, rep: dict) -> None:
    """loss.png (CPT and SFT), rl_reward.png (RL rollouts), pass_at_1.png (before/after RL +- SE)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, name in zip(axes, ("cpt", "sft")):
        rows = _metrics(os.path.join(workdir, name))
        x, y = _curve(rows, "loss")
        ax.plot(x, y, label="train loss" + (" (transcripts)" if name == "sft" else ""))
        x, y = _curve(rows, "eval/heldout_loss")
        if x:
            ax.plot(x, y, "o-", label="held-out loss (code corpus)")
        ax.set(title=name.upper(), xlabel="step", ylabel="loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, PLOTS["loss"]), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    rows = _metrics(os.path.join(workdir, "rl"))
    for key, label in (("reward", "mean reward"), ("pass_rate", "pass rate")):
        x, y = _curve(rows, key)
        ax.plot(x, y, "o-", label=label)
    ax.set(title="RL training rollouts", xlabel="learner step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, PLOTS["rl"]), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(4.5, 3.6))
    ev = rep.get("heldout") or {}
    names = [n for n in ("sft", "rl") if n in ev]
    ax.bar(range(len(names)), [ev[n]["pass_at_1"] for n in names],
           yerr=[ev[n]["se"] or 0.0 for n in names], capsize=6, color=["tab:blue", "tab:orange"][:len(names)])
    ax.set_xticks(range(len(names)), [{"sft": "SFT", "rl": "SFT -> RL"}[n] for n in names])
    e0 = ev[names[0]] if names else {}
    ax.set(ylabel="held-out pass@1 (+- SE)", ylim=(0, 1),
           title=f"{e0.get('tasks', '?')} tasks x {e0.get('passes', '?')} attempts")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, PLOTS["pass_at_1"]), dpi=100)
    plt.close(fig)


def _episode_limits(ep: dict | None) -> str:
    """', at most T turns of N tokens, B in all' for the eval row (reports written before it: '')."""
    if not ep:
        return ""
    return f", at most {ep['max_turns']} turns of {ep['max_new_tokens']} tokens, {ep['max_total_tokens']} in all"


def write_demo_report(workdir: str, info: dict) -> dict:
    """Write workdir/report.json, report.md and the PNG plots; returns the report dict."""
    rep = build_report(workdir, info)
    write_plots(workdir, rep)
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(rep, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(render_markdown(rep))
    return rep
