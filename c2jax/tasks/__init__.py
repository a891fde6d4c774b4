"""Task sources and verifiers: synthetic repos, stdlib bug injection, HumanEval, behaviour.

`load_suite(name, split, n=None, seed=0, **kw)` is the one entry point:
  "synthetic" (kw level=1|2|3, or name "synthetic:2"), "stdlib_bugs", "humaneval", "behaviour".
Other suites come in with `register_suite(name, loader)`, by module path ("package.module:loader")
or by the entry-point group "c2jax.task_suites"; a loader is `loader(split, n, seed, **kw) ->
list[Task]`, deterministic in its arguments. c2jax/tasks/README.md shows how to write tasks
(hidden-test layout, answers as patterns or functions, rule checks) with a worked example.

Splits never share a task: synthetic and behaviour tasks are assigned by a hash of their
content (~20% heldout), HumanEval by problem id (~20%), stdlib bugs by module.

Also here: `suite_stats(tasks)` (median prompt chars / reference lines changed per suite),
`validate_task(task, run=local_run)` (reference passes, unmodified and bad outcomes fail;
see c2jax.tasks.validate, also `python -m c2jax.tasks.validate SUITE [SPLIT] [N] [SEED]`),
and the behaviour graders as plain functions in c2jax.tasks.behaviour (check_* and
`behaviour_reward_terms`) for RL rewards.
"""
from __future__ import annotations

from c2jax.tasks.base import (  # noqa: F401
    Grade,
    LocalRunResult,
    Task,
    apply_reference,
    lines_changed,
    local_run,
    reference_files,
    snapshot_files,
)
from c2jax.tasks.registry import (  # noqa: F401
    SPLITS,
    available_suites,
    load_suite,
    register_suite,
    suite_stats,
)


def validate_task(task: Task, run=local_run):
    """c2jax.tasks.validate.validate_task (imported on use: `python -m c2jax.tasks.validate` must
    find that module not yet imported when it runs it as __main__)."""
    from c2jax.tasks.validate import validate_task as _v
    return _v(task, run)
