"""Task validation: the reference solution passes and the unmodified task fails.

For behaviour tasks the reference includes the reference final message and tool calls, and
every listed bad outcome (doing nothing, editing while answering, touching tests, leaving a
debug print, ignoring the interruption ...) must fail as well.

Usage: `python -m c2jax.tasks.validate SUITE [SPLIT] [N] [SEED]`, SUITE a registered name or
       `package.module:loader` for a suite outside the package (c2jax/tasks/README.md),
       e.g. `python -m c2jax.tasks.validate synthetic:1 train 50`.
`run` defaults to `local_run` (no sandbox): fine here, since only trusted code runs (task
files and reference solutions written by this package).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from c2jax.tasks.base import (
    Task,
    apply_edit_to_files,
    local_run,
    reference_files,
    write_files,
)
from c2jax.tasks.registry import load_suite, suite_stats


@dataclasses.dataclass
class ValidationResult:
    task_id: str
    ok: bool
    reference_passed: bool
    unmodified_failed: bool
    bad_outcomes_failed: dict[str, bool] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def _grade_state(task: Task, files: dict[str, str], final_message: str, tool_calls: list[dict], run):
    with tempfile.TemporaryDirectory(prefix="c2jax_validate_") as d:
        write_files(Path(d), files)
        episode = {"final_message": final_message, "tool_calls": tool_calls, "original_files": task.files}
        return task.grade(Path(d), run, episode=episode)


def validate_task(task: Task, run=local_run) -> ValidationResult:
    """Check one task: its reference passes, the unmodified repo and every listed bad outcome fail."""
    t0 = time.monotonic()
    problems: list[str] = []
    try:
        ref_files = reference_files(task)
    except ValueError as e:
        return ValidationResult(task.task_id, False, False, False, {}, [f"reference does not apply: {e}"],
                                time.monotonic() - t0)
    g = _grade_state(task, ref_files, task.reference_message, task.reference_solution, run)
    ref_ok = g.passed
    if not ref_ok:
        problems.append(f"reference fails: {str(g.details)[:600]}")
    g0 = _grade_state(task, dict(task.files), "", [], run)
    unmod_failed = not g0.passed
    if not unmod_failed:
        problems.append("the unmodified task passes")
    bads: dict[str, bool] = {}
    for bad in (task.metadata.get("behaviour") or {}).get("bad_outcomes", []):
        if bad["name"] == "do_nothing":
            bads["do_nothing"] = unmod_failed
            continue
        files = dict(task.files)
        for call in bad["edits"]:
            files = apply_edit_to_files(files, call)
        gb = _grade_state(task, files, bad["final_message"], bad["edits"], run)
        bads[bad["name"]] = not gb.passed
        if gb.passed:
            problems.append(f"bad outcome {bad['name']!r} passes")
    ok = ref_ok and unmod_failed and all(bads.values())
    return ValidationResult(task.task_id, ok, ref_ok, unmod_failed, bads, problems, time.monotonic() - t0)


def validate_tasks(tasks: list[Task], run=local_run, workers: int = 2) -> list[ValidationResult]:
    with cf.ThreadPoolExecutor(max(1, workers)) as ex:
        return list(ex.map(lambda t: validate_task(t, run), tasks))


def validate_suite(name: str, split: str = "train", n: int | None = None, seed: int = 0,
                   run=local_run, workers: int = 2, verbose: bool = True) -> dict:
    """Generate and validate a suite; print and return counts."""
    t0 = time.monotonic()
    tasks = load_suite(name, split, n=n, seed=seed)
    t_gen = time.monotonic() - t0
    results = validate_tasks(tasks, run, workers)
    summary = {"suite": name, "split": split, "n": len(tasks), "valid": sum(r.ok for r in results),
               "reference_failed": sum(not r.reference_passed for r in results),
               "unmodified_passed": sum(not r.unmodified_failed for r in results),
               "bad_outcome_passed": sum(not all(r.bad_outcomes_failed.values()) for r in results),
               "generate_s": round(t_gen, 2), "validate_s": round(time.monotonic() - t0 - t_gen, 2),
               "stats": suite_stats(tasks), "invalid": [(r.task_id, r.problems) for r in results if not r.ok]}
    if verbose:
        print(f"{name} [{split}] n={summary['n']} valid={summary['valid']} "
              f"reference_failed={summary['reference_failed']} unmodified_passed={summary['unmodified_passed']} "
              f"bad_outcome_passed={summary['bad_outcome_passed']} "
              f"gen={summary['generate_s']}s validate={summary['validate_s']}s")
        print(f"  stats: {summary['stats']}")
        for tid, probs in summary["invalid"][:10]:
            print(f"  INVALID {tid}: {probs}")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    name = args[0]
    split = args[1] if len(args) > 1 else "train"
    n = int(args[2]) if len(args) > 2 else None
    seed = int(args[3]) if len(args) > 3 else 0
    s = validate_suite(name, split, n, seed)
    return 0 if s["valid"] == s["n"] else 1


if __name__ == "__main__":
    sys.exit(main())
