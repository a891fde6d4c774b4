"""What the agent harness needs from a task (c2jax.tasks.base.Task satisfies it).

The harness only consumes tasks; c2jax.tasks owns them. Duck-typed: any object with these
attributes works (tests use a tiny fake).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# run(argv, workdir, timeout_s, stdin=None) -> object with returncode, stdout, stderr, timed_out.
RunFn = Callable[[list[str], Path, float], Any]


@runtime_checkable
class GradeLike(Protocol):
    passed: bool
    score: float
    details: dict


@runtime_checkable
class TaskLike(Protocol):
    task_id: str
    suite: str
    split: str
    prompt: str
    files: dict[str, str]                 # the repository the agent sees
    hidden_tests: dict[str, str]          # used by grade() only, never visible to the agent
    reference_solution: list[dict]        # [{"name": tool, "arguments": {...}}, ...] (oracle)
    system_rules: str | None              # extra rules appended to the system prompt
    interruption: tuple[int, str] | None  # (n, msg): inject `msg` after the n-th assistant turn
    tools: list[str] | None               # per-environment tool set (None: harness default)

    def grade(self, workspace_path: Path, run: RunFn, episode: dict | None = None) -> GradeLike:
        """Grades the final workspace; `run` is the harness sandbox's run.

        episode: {"final_message": str, "tool_calls": [{"name", "arguments"}, ...],
                  "original_files": dict[str, str]}.
        """
        ...


def task_attr(task: Any, name: str, default: Any = None) -> Any:
    """Optional task fields (reference_message, test_command, timeout_s, metadata, ...)."""
    return getattr(task, name, default)
