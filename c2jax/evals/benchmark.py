"""Benchmark runner: a policy over task suites for several passes -> report.md + report.json.

Per suite: accuracy (mean over passes of the fraction of tasks passed), pass@k (unbiased
estimator over the n passes), mean score, and per task means of completion tokens, tool
calls, turns, wall time and estimated inference FLOPs (2 * active_params * tokens in the
trajectory, i.e. every prompt and generated token passes through the model once with a KV
cache); the malformed-call rate (malformed / all tool calls); the median prompt length in
characters and the median lines changed (added + removed) by the reference fix.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from c2jax.agent.runner import EpisodeConfig, EpisodeResult, exception_metrics, run_episodes
from c2jax.evals.config import eval_defaults
from c2jax.progress import Heartbeat
from c2jax.tasks.base import diff_line_counts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def default_ks(n: int) -> list[int]:
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    return ks + ([n] if n not in ks else [])


def reference_lines_changed(task: Any) -> int | None:
    """Lines added + removed when task.reference_solution's edit/write calls are applied."""
    files = dict(task.files)
    try:
        for item in task.reference_solution:
            for call in (item if isinstance(item, (list, tuple)) else [item]):
                a = call.get("arguments", {})
                if call.get("name") == "write_file":
                    files[a["path"]] = a["content"]
                elif call.get("name") == "edit_file":
                    text = files[a["path"]]
                    if text.count(a["old"]) != 1:
                        return None
                    files[a["path"]] = text.replace(a["old"], a["new"], 1)
    except (KeyError, TypeError, AttributeError):
        return None
    return sum(diff_line_counts(task.files, files))


def _passed(r: EpisodeResult) -> bool:
    return bool(getattr(r.grade, "passed", False))


def _score(r: EpisodeResult) -> float:
    return float(getattr(r.grade, "score", 0.0))


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


def summarize_suite(tasks: list, results: list[list[EpisodeResult]], passes: int,
                    active_params: float | None, ks: list[int]) -> dict:
    """results[i][p]: task i, pass p."""
    flat = [r for rs in results for r in rs]
    per_pass_acc = [_mean(_passed(results[i][p]) for i in range(len(tasks))) for p in range(passes)]
    counts = [sum(_passed(r) for r in rs) for rs in results]
    calls = sum(r.stats["tool_calls"] for r in flat)
    malformed = sum(r.stats["malformed_calls"] for r in flat)
    ref_lines = [x for x in (reference_lines_changed(t) for t in tasks) if x is not None]
    out = {
        "tasks": len(tasks), "passes": passes,
        "accuracy": _mean(per_pass_acc),
        "accuracy_per_pass": per_pass_acc,
        "accuracy_std_over_passes": statistics.pstdev(per_pass_acc) if len(per_pass_acc) > 1 else 0.0,
        "pass_at_k": {str(k): _mean(pass_at_k(passes, c, k) for c in counts) for k in ks},
        "mean_score": _mean(_score(r) for r in flat),
        "completion_tokens_per_task": _mean(r.stats["completion_tokens"] for r in flat),
        "total_tokens_per_task": _mean(len(r.trajectory.tokens_T) for r in flat),
        "tool_calls_per_task": _mean(r.stats["tool_calls"] for r in flat),
        "turns_per_task": _mean(r.stats["turns"] for r in flat),
        "wall_s_per_task": _mean(r.stats["wall_s"] for r in flat),
        "malformed_call_rate": (malformed / calls) if calls else 0.0,
        "finish_reasons": dict(sorted(_count(r.stats["finish_reason"] for r in flat).items())),
        **exception_metrics([r.stats for r in flat]),
        "median_prompt_chars": statistics.median(len(t.prompt) for t in tasks) if tasks else 0,
        "median_reference_lines_changed": statistics.median(ref_lines) if ref_lines else None,
    }
    if active_params:
        out["inference_flops_per_task"] = 2.0 * float(active_params) * out["total_tokens_per_task"]
    return out


def _count(xs) -> dict:
    d: dict = {}
    for x in xs:
        d[x] = d.get(x, 0) + 1
    return d


def run_benchmark(tasks_by_suite: dict[str, list], policy_factory: Callable[[Any], Any], passes: int = 1, *,
                  tokenizer=None, sandbox=None, config: EpisodeConfig | None = None,
                  out_dir: str | Path | None = None, active_params: float | None = None,
                  concurrency: int = 8, ks: list[int] | None = None, policy_name: str = "") -> dict:
    """Runs every task `passes` times; returns the report dict (and writes it under out_dir)."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    if sandbox is None:
        from c2jax.agent.sandbox import Sandbox
        sandbox = Sandbox()
    ks = ks or default_ks(passes)
    t0 = time.monotonic()
    report: dict[str, Any] = {"policy": policy_name, "passes": passes, "active_params": active_params,
                              "suites": {}, "tasks": {}}
    beat = Heartbeat(f"eval {policy_name}".strip(), sum(len(ts) for ts in tasks_by_suite.values()) * passes)
    lock, passed = threading.Lock(), [0]

    def finished(_, r):  # run_episodes calls this from its worker threads
        with lock:
            passed[0] += _passed(r)
            beat.note = f"{passed[0]} passed"
        beat.add()

    with beat:
        for suite, tasks in tasks_by_suite.items():
            jobs = [t for t in tasks for _ in range(passes)]
            res = run_episodes(jobs, policy_factory, tokenizer, sandbox, config, concurrency=concurrency,
                               on_result=finished)
            grid = [res[i * passes:(i + 1) * passes] for i in range(len(tasks))]
            report["suites"][suite] = summarize_suite(tasks, grid, passes, active_params, ks)
            report["tasks"][suite] = [
                {"task_id": t.task_id, "passed": [_passed(r) for r in rs], "score": [_score(r) for r in rs],
                 "completion_tokens": [r.stats["completion_tokens"] for r in rs],
                 "tool_calls": [r.stats["tool_calls"] for r in rs], "turns": [r.stats["turns"] for r in rs],
                 "finish_reason": [r.stats["finish_reason"] for r in rs]}
                for t, rs in zip(tasks, grid)]
    report["wall_s"] = time.monotonic() - t0
    if out_dir is not None:
        write_report(report, Path(out_dir))
    return report


COLUMNS = [("accuracy", "acc", "{:.3f}"), ("mean_score", "score", "{:.3f}"),
           ("completion_tokens_per_task", "compl. tok", "{:.0f}"), ("tool_calls_per_task", "tool calls", "{:.1f}"),
           ("turns_per_task", "turns", "{:.1f}"), ("wall_s_per_task", "wall s", "{:.2f}"),
           ("inference_flops_per_task", "FLOPs", "{:.3g}"), ("malformed_call_rate", "malformed", "{:.3f}"),
           ("median_prompt_chars", "prompt chars (med)", "{:.0f}"),
           ("median_reference_lines_changed", "ref lines (med)", "{:.0f}"),
           ("grader_exceptions", "grader exc.", "{:d}"), ("harness_exceptions", "harness exc.", "{:d}"),
           ("truncated_turns", "truncated turns", "{:d}")]


def render_markdown(report: dict) -> str:
    suites = report["suites"]
    ks = sorted({int(k) for s in suites.values() for k in s["pass_at_k"]})
    head = ["suite", "tasks", "passes"]
    head += [COLUMNS[0][1]] + [f"pass@{k}" for k in ks] + [c[1] for c in COLUMNS[1:]]
    lines = [f"# Benchmark: {report.get('policy') or 'policy'}, {report['passes']} pass(es)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in suites.items():
        row = [name, str(s["tasks"]), str(s["passes"]), COLUMNS[0][2].format(s["accuracy"])]
        row += [f"{s['pass_at_k'][str(k)]:.3f}" if str(k) in s["pass_at_k"] else "-" for k in ks]
        for key, _, fmt in COLUMNS[1:]:
            v = s.get(key)
            row.append("-" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(row) + " |")
    for name, s in suites.items():
        for kind in ("grader", "harness"):
            if s.get(f"{kind}_exception_types"):
                lines.append(f"\n{name}: {kind} exceptions by type: "
                             + ", ".join(f"{k} x{v}" for k, v in s[f"{kind}_exception_types"].items()))
    lines += ["", (f"Total wall time: {report.get('wall_s', 0):.1f} s. Accuracy is the mean over passes of the "
              "fraction of tasks passed; pass@k uses the unbiased estimator; FLOPs = 2 x active params x "
              "trajectory tokens.")]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable))
    (out_dir / "report.md").write_text(render_markdown(report))


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


# ----- config-driven entry (`python -m c2jax eval --config ... --workdir ...`) ------------------
def _load_suite(name: str, e) -> list:
    """load_suite, with a ConfigError naming eval.suites / eval.split for a name it does not know."""
    from c2jax.errors import ConfigError
    from c2jax.tasks import load_suite
    try:
        return load_suite(name, e.split, e.n_per_suite or None, e.seed)
    except ValueError as err:
        if str(err).startswith(("unknown task suite", "split must be", f"suite {name.split(':')[0]!r}")):
            raise ConfigError(f"eval.suites / eval.split: {err}") from None
        raise


def main_eval(cfg, workdir: str | Path, *, policy_factory: Callable[[Any], Any] | None = None,
              tokenizer=None, tasks_by_suite: dict[str, list] | None = None) -> dict:
    """Runs the benchmark described by cfg.eval (defaults above); writes workdir/report.{md,json}."""
    from c2jax.agent.policy import DoNothingPolicy, OraclePolicy
    e = eval_defaults()
    if cfg is not None and "eval" in cfg:
        e.update(dict(cfg.eval))
    if tasks_by_suite is None:
        tasks_by_suite = {s: _load_suite(s, e) for s in e.suites}
    if policy_factory is None:
        if e.policy == "oracle":
            policy_factory = OraclePolicy
        elif e.policy == "do_nothing":
            policy_factory = lambda task: DoNothingPolicy()
        else:
            raise ValueError(f"eval.policy={e.policy!r} needs a policy_factory (the model sampler); "
                             "use 'oracle' or 'do_nothing' for scripted runs")
    ep = EpisodeConfig(max_turns=e.max_turns, max_total_tokens=e.max_total_tokens,
                       max_new_tokens=e.max_new_tokens, run_timeout_s=e.run_timeout_s)
    return run_benchmark(tasks_by_suite, policy_factory, e.passes, tokenizer=tokenizer, config=ep,
                         out_dir=workdir, active_params=e.active_params or None,
                         concurrency=e.concurrency, policy_name=e.policy)
