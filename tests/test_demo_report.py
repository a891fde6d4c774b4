"""The demo's report (c2jax.demo_report) from synthetic run outputs: report.md, report.json and
the plots are written, every figure in report.md is one of report.json's, the paired change
and its standard error are right, and the heartbeat prints while work goes on."""
import io
import json
import os
import re
import time

import numpy as np

from c2jax import demo_report
from c2jax.progress import Heartbeat


def _write_run(d, rng, steps, evals=True):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        if evals:
            f.write(json.dumps({"step": 0, "eval/heldout_loss": float(rng.uniform(6, 7))}) + "\n")
        for s in range(5, steps + 1, 5):
            f.write(json.dumps({"step": s, "loss": float(rng.uniform(1, 6)), "lr": 1e-3}) + "\n")
        if evals:
            f.write(json.dumps({"step": steps, "eval/heldout_loss": float(rng.uniform(4, 6))}) + "\n")
    os.makedirs(os.path.join(d, "checkpoints"), exist_ok=True)
    os.makedirs(os.path.join(d, "tb"), exist_ok=True)
    ev = lambda: {"heldout_loss": float(rng.uniform(3, 7)), "codebase_ppl": float(rng.uniform(50, 900))}  # noqa: E731
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({"initial_eval": ev(), "final_eval": ev(), "final_step": steps}, f)


def _write_eval(d, passed):
    os.makedirs(d, exist_ok=True)
    n, k = passed.shape
    counts = passed.sum(1)
    rep = {"suites": {"synthetic:1": {
        "tasks": n, "passes": k, "accuracy": float(passed.mean()),
        "pass_at_k": {"1": float(passed.mean()), str(k): float((counts > 0).mean())},
        "completion_tokens_per_task": 57.3, "malformed_call_rate": 0.0625}},
        "tasks": {"synthetic:1": [{"task_id": f"t{i}", "passed": [bool(x) for x in row]} for i, row in enumerate(passed)]}}
    with open(os.path.join(d, "report.json"), "w") as f:
        json.dump(rep, f)


def _synthetic_demo(tmp_path, rng, n_tasks=24, k=4):
    wd = str(tmp_path / "demo")
    _write_run(os.path.join(wd, "cpt"), rng, 150)
    _write_run(os.path.join(wd, "sft"), rng, 100, evals=False)
    os.makedirs(os.path.join(wd, "rl"), exist_ok=True)
    with open(os.path.join(wd, "rl", "metrics.jsonl"), "w") as f:
        for s in [*range(1, 9), *range(5, 9)]:  # steps 5-8 again: a resumed run appends
            f.write(json.dumps({"step": s, "reward": float(rng.uniform(-1, 1)), "pass_rate": float(rng.uniform())}) + "\n")
    before = rng.uniform(size=(n_tasks, k)) < rng.uniform(0.1, 0.5)
    after = rng.uniform(size=(n_tasks, k)) < rng.uniform(0.1, 0.5)
    _write_eval(os.path.join(wd, "eval_sft"), before)
    _write_eval(os.path.join(wd, "eval_rl"), after)
    info = {"mode": "default", "sizes": {"transcripts": 64, "sft_steps": 100, "rl_steps": 8, "eval_tasks": n_tasks,
                                         "eval_passes": k, "rl_config": "configs/rl_tiny.py"},
            "rl_shape": {"config": "configs/rl_tiny.py", "prompts_per_step": int(rng.integers(2, 40)),
                         "group_size": int(rng.integers(2, 16))},
            "overrides": [], "commands": {"cpt": "python -m c2jax pretrain", "sft": "python -m c2jax sft",
                                          "rl": "python -m c2jax rl"},
            "wall_s": {k: float(rng.uniform(1, 500)) for k in ("cpt", "transcripts", "sft", "rl", "eval", "total")},
            "transcripts": {"tasks": 64, "kept": 60, "failed": 4, "too_long": 0}, "temperature": 0.7,
            "eval_episode": {"max_turns": int(rng.integers(2, 9)), "max_new_tokens": int(rng.integers(64, 300)),
                             "max_total_tokens": int(rng.integers(500, 3000))}}
    return wd, info, before, after


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield float(obj)


def test_report_and_plots_from_synthetic_runs(tmp_path):
    rng = np.random.default_rng()  # fresh numbers each run: the report must not depend on them
    wd, info, before, after = _synthetic_demo(tmp_path, rng)
    rep = demo_report.write_demo_report(wd, info)
    for name in ("report.md", "report.json", *demo_report.PLOTS.values()):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    for png in demo_report.PLOTS.values():
        with open(os.path.join(wd, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    with open(os.path.join(wd, "report.json")) as f:
        js = json.load(f)
    assert js == json.loads(json.dumps(rep))
    md = open(os.path.join(wd, "report.md")).read()
    values = list(_numbers(js))
    figures = re.findall(r"[-+]?\d+\.\d+", md)
    assert len(figures) >= 20
    for fig in figures:
        places = len(fig.split(".")[1])
        assert any(abs(round(v, places) - float(fig)) < 0.5 * 10 ** -places + 1e-12 for v in values), \
            f"{fig} in report.md is not in report.json"
    # the figures the report is for, each in both files
    assert js["rl"]["steps"] == 8
    ev, c = js["heldout"], js["rl_change"]
    assert ev["sft"]["pass_at_1"] == before.mean() and ev["rl"]["pass_at_1"] == after.mean()
    for fig in (f"{ev['sft']['pass_at_1']:.3f} +- {ev['sft']['se']:.3f}", f"{ev['rl']['pass_at_1']:.3f} +- "
                f"{ev['rl']['se']:.3f}", f"change {c['change']:+.3f} +- {c['se']:.3f}",
                f"{js['cpt']['heldout_loss_first']:.3f} -> {js['cpt']['heldout_loss_last']:.3f}"):
        assert fig in md, fig
    assert ("within noise" in md) == c["within_noise"]
    if not c["within_noise"]:
        assert f"({c['change'] / c['se']:+.1f} standard errors)" in md
    shape = info["rl_shape"]
    assert f"8 steps x {shape['prompts_per_step']} prompts x {shape['group_size']} attempts (configs/rl_tiny.py)" in md
    ep = info["eval_episode"]
    assert (f"temperature 0.7, at most {ep['max_turns']} turns of {ep['max_new_tokens']} tokens, "
            f"{ep['max_total_tokens']} in all") in md
    for p in (*js["paths"]["checkpoints"].values(), *js["paths"]["tensorboard"].values()):
        assert f"`{p}`" in md
    assert "--full" in md and "configs/rl_tiny.py" in md
    full_md = demo_report.render_markdown({**js, "mode": "full"})
    assert f"demo --workdir {wd} --full` (full setting)" in full_md  # the command that ran
    assert "- the longer setting" not in full_md and "experiments/rl_learning.py --sft" in full_md


def test_paired_change_and_noise():
    rng = np.random.default_rng()
    before = rng.uniform(size=40)
    after = np.clip(before + rng.normal(0, 0.2, 40), 0, 1)
    c = demo_report.paired_change(before, after)
    d = after - before
    assert np.isclose(c["change"], d.mean()) and np.isclose(c["se"], d.std(ddof=1) / np.sqrt(40))
    assert c["within_noise"] == (abs(d.mean()) < 2 * c["se"])
    assert not demo_report.paired_change([0.0] * 10, [0.5, 0.6] * 5)["within_noise"]
    assert demo_report.paired_change([0.5] * 10, [0.5] * 10)["within_noise"]
    assert np.isclose(c["change_in_se"], d.mean() / c["se"])
    drop = demo_report.paired_change(before, np.clip(before - rng.uniform(0.2, 0.6, 40), 0, 1))
    line = demo_report.rl_sentence({"rl_change": drop, "heldout": {"sft": {"pass_at_1": 0.5}, "rl": {"pass_at_1": 0.2}}})
    assert not drop["within_noise"] and f"a drop ({drop['change_in_se']:+.1f} standard errors)" in line
    flat = demo_report.paired_change([0.25] * 6, [0.5] * 6)  # every task up by the same amount: zero spread
    assert not flat["within_noise"] and flat["change_in_se"] is None
    rep = {"rl_change": flat, "heldout": {"sft": {"pass_at_1": 0.25}, "rl": {"pass_at_1": 0.5}}}
    assert "a rise, more than 2 standard errors: beyond noise" in demo_report.rl_sentence(rep)
    assert demo_report.paired_change([0.0, 1.0] * 5, [1.0, 0.0] * 5)["within_noise"]


def test_heartbeat_prints_progress_and_eta():
    out = io.StringIO()
    with Heartbeat("eval", 10, every=0.05, stream=out) as beat:
        beat.note = lambda: "3 passed"
        for _ in range(4):
            beat.add()
            time.sleep(0.06)
    lines = out.getvalue().splitlines()
    assert lines and lines[-1].startswith("eval: 4/10 | elapsed 0m00s | ETA 0m00s | 3 passed"), lines
    quiet = io.StringIO()
    with Heartbeat("rl", 5, every=0.2, stream=quiet) as beat:
        for _ in range(5):
            beat.touch()  # the caller printed its own line: the heartbeat stays quiet
            time.sleep(0.05)
    assert quiet.getvalue() == ""
