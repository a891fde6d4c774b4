"""Hooks for task sets written outside this package (see c2jax/tasks/README.md).

* A question's answer: substrings (`expected_any`), regular expressions (`answer_patterns`)
  or a grader function (`answer_grader`), in a BehaviourTask's metadata["behaviour"].
* Rule checks: `Task.rule_checks`, small functions over the episode's end state.
* Functions are given as callables or as "package.module:function" strings (strings keep a
  Task picklable for worker processes).

A rule check gets one RuleContext and returns a bool, a (bool, details) pair or a Check. An
exception in a check propagates: the episode runner counts it as a grader exception.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    score: float
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What a rule check sees: the repository before and after, and what the agent said and did."""
    original_files: dict[str, str]
    final_files: dict[str, str]
    final_message: str
    tool_calls: list[dict]
    task: Any

    def changed_paths(self) -> list[str]:
        """Paths added, removed or edited."""
        a, b = self.original_files, self.final_files
        return sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))


def resolve(ref: Callable | str, what: str = "function") -> Callable:
    """A callable, or the function named by "package.module:function"."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or ":" not in ref:
        raise ValueError(f"{what} {ref!r} must be a callable or a 'package.module:function' string")
    mod_name, _, attr = ref.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{what} {ref!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{what} {ref!r}: {mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{what} {ref!r} is not callable")
    return fn


def check_ref_format(ref: Any, what: str) -> None:
    """Raises ValueError unless `ref` is a callable or a 'module:function' string (not imported)."""
    if not (callable(ref) or (isinstance(ref, str) and ":" in ref and all(ref.partition(":")[::2]))):
        raise ValueError(f"{what} {ref!r} must be a callable or a 'package.module:function' string")


def _name(ref) -> str:
    return ref.rpartition(":")[2] if isinstance(ref, str) else getattr(ref, "__name__", "rule_check")


def as_check(name: str, out: Any) -> Check:
    """A check function's result (bool, float in [0, 1], (bool, details) or Check) as a Check."""
    if isinstance(out, Check):
        return out
    if hasattr(out, "passed") and hasattr(out, "score"):
        return Check(getattr(out, "name", name), bool(out.passed), float(out.score), dict(getattr(out, "details", {})))
    details: dict = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        out, details = out
    if isinstance(out, bool):
        return Check(name, out, float(out), details)
    if isinstance(out, (int, float)) and 0.0 <= float(out) <= 1.0:
        return Check(name, float(out) == 1.0, float(out), details)
    raise TypeError(f"check {name!r} returned {out!r}; return a bool, a score in [0, 1], (bool, details) or a Check")


def run_rule_checks(task: Any, ctx: RuleContext) -> list[Check]:
    """Runs task.rule_checks on `ctx`, in order."""
    return [as_check(_name(ref), resolve(ref, "rule check")(ctx)) for ref in getattr(task, "rule_checks", ()) or ()]


def check_answer_patterns(final_message: str, patterns: list[str]) -> Check:
    """The final message matches one of the regular expressions (re.search, case-insensitive
    unless the pattern sets its own flags)."""
    msg = final_message or ""
    hit = next((p for p in patterns if re.search(p, msg, re.IGNORECASE | re.MULTILINE)), None)
    return Check("answer_pattern", hit is not None, float(hit is not None), {"matched": hit})


def check_answer_grader(ref: Callable | str, final_message: str, task: Any) -> Check:
    """`fn(final_message, task)` decides (bool, score, (bool, details) or Check)."""
    return as_check("answer_grader", resolve(ref, "answer grader")(final_message or "", task))
