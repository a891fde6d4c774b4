"""The Task record, its grader, and the helpers every task source shares.

A task is a small repository (`files`) plus a terse prompt. The agent edits the repository;
at grading time the `hidden_tests` run against the final tree through the caller's `run`
callable (the harness sandbox). Two protocols:

* `test_command=None` (every built-in suite): the hidden tests are Python
  files run by the harness's own runner (c2jax.tasks.hidden_runner), which never imports the
  task's code in the process that judges it and reports per test over a signed channel the
  code under test cannot forge (see that module for the threat model). The tests never touch
  the disk, so their paths are only names, in any layout.
* a `test_command` list: the hidden tests are written at their paths in the tree, the command
  runs, they are removed again; the pass signal is `PASS_MARKER + nonce` on stdout. The code
  under test shares a process with such tests and could forge it; use it for trusted runners
  only. stdlib_bugs, whose CPython unittest files must import the module under test,
  overrides `run_hidden_tests` with a guarded in-process runner (c2jax.tasks.stdlib_bugs).

Every host-side read of the tree goes through c2jax.filetree.read_tree (no link is
followed; as the tree's owner when the harness is root).

Python version: the stdlib-bug tasks run CPython 3.12's own test files (they import
`test.support`), so the interpreter the sandbox exposes as `python3` must be Python 3.12.
`local_run` maps "python3" to `sys.executable`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

HIDDEN_DIR = ".c2jax_hidden"
NONCE_PLACEHOLDER = "__C2JAX_NONCE__"
PASS_MARKER = "C2JAX_ALL_PASSED "
# Written at the top of every hidden plain-python test script (run by the harness runner,
# from the task root).
HIDDEN_PREAMBLE = (
    "def _same(got, want):\n"
    "    # exact type first: an object whose __eq__ always says True must not pass\n"
    "    if type(got) is not type(want):\n"
    "        return False\n"
    "    if isinstance(want, (list, tuple)):\n"
    "        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))\n"
    "    if isinstance(want, dict):\n"
    "        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)\n"
    "    return want == got\n"
)
# Files and directories never counted as part of the repository state.
IGNORED_PARTS = frozenset({"__pycache__", HIDDEN_DIR, ".git", ".pytest_cache", ".ruff_cache"})
EDIT_TOOLS = frozenset({"edit_file", "write_file", "delete_file", "apply_patch", "create_file"})


class RunResult(Protocol):
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


Runner = Callable[[list[str], Path, float], RunResult]


@dataclasses.dataclass
class LocalRunResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


def local_run(argv: list[str], workdir: Path, timeout_s: float = 60.0, stdin: str | None = None) -> LocalRunResult:
    """Run `argv` in `workdir` as a plain subprocess, NO sandbox.

    For trusted code only: reference solutions, unmodified tasks, tests of this package.
    Never use it on model-written code; use the harness sandbox's run instead.
    "python3" as argv[0] is mapped to this interpreter (Python 3.12).
    """
    argv = list(argv)
    if argv and argv[0] in ("python3", "python"):
        argv[0] = sys.executable
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONHASHSEED"] = "0"
    try:
        p = subprocess.run(argv, check=False, cwd=str(workdir), capture_output=True, text=True,
                           timeout=timeout_s, env=env, start_new_session=True, input=stdin,
                           stdin=None if stdin is not None else subprocess.DEVNULL)
        return LocalRunResult(p.returncode, p.stdout, p.stderr, False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return LocalRunResult(-9, out, err, True)


@dataclasses.dataclass
class Grade:
    passed: bool
    score: float
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Task:
    """One agent task. See the module docstring for the grading protocol.

    reference_solution: tool calls a scripted oracle replays, each
      {"name": "edit_file", "arguments": {"path", "old", "new"}} (exact, unique match) or
      {"name": "write_file", "arguments": {"path", "content"}}.
    reference_message: the oracle's final message (matters for behaviour tasks, e.g. the
      answer to a question).
    interruption: (n, message): after the agent's n-th assistant turn (1-based), the runner
      injects `message` as a user turn; the final state must meet the new requirement.
    tools: tool names the task allows (None: the harness default set).
    rule_checks: the task's own checks of the end state (c2jax.tasks.authoring.RuleContext ->
      bool | (bool, details) | Check); all must pass, on top of the hidden tests.
    grader: None for test-verified tasks; behaviour tasks (c2jax.tasks.behaviour.BehaviourTask,
      which grades them) name their check set and keep its parameters in metadata["behaviour"].
    """

    task_id: str
    suite: str
    split: str  # "train" | "heldout"
    prompt: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    test_command: list[str] | None  # None: the harness runner (see the module docstring)
    reference_solution: list[dict]
    system_rules: str | None = None
    interruption: tuple[int, str] | None = None
    tools: list[str] | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    reference_message: str = ""
    grader: str | None = None
    timeout_s: float = 60.0
    rule_checks: tuple = ()  # c2jax.tasks.authoring: callables or "module:function" strings
    uses_harness_runner = True  # class attribute: subclasses with their own runner set False

    def __post_init__(self):
        if self.split not in ("train", "heldout"):
            raise ValueError(f"Task {self.task_id}: split must be 'train' or 'heldout', got {self.split!r}")
        for p in list(self.files) + list(self.hidden_tests):
            if p.startswith("/") or ".." in Path(p).parts:
                raise ValueError(f"Task {self.task_id}: file path {p!r} must be relative, inside the repo")
        from c2jax.tasks.authoring import check_ref_format
        self.rule_checks = tuple(self.rule_checks or ())
        for ref in self.rule_checks:
            check_ref_format(ref, f"Task {self.task_id}: rule check")
        if self.grader is None and not self.hidden_tests and not self.rule_checks:
            raise ValueError(f"Task {self.task_id}: nothing to grade; give it hidden_tests or rule_checks (or build a "
                             "c2jax.tasks.behaviour.BehaviourTask, e.g. a question)")
        overlap = set(self.files) & set(self.hidden_tests)
        if overlap:
            raise ValueError(f"Task {self.task_id}: hidden tests {sorted(overlap)} are also repository files")
        if self.test_command is None and self.hidden_tests and self.uses_harness_runner:
            from c2jax.tasks.grading import expected_test_ids, stdlib_shadows
            try:
                expected_test_ids(self.hidden_tests)
            except ValueError as e:
                raise ValueError(f"Task {self.task_id}: {e}") from None
            shadows = stdlib_shadows(self.files, self.hidden_tests)
            if shadows:
                raise ValueError(f"Task {self.task_id}: the hidden tests import {shadows}, which are task modules "
                                 "named like standard-library ones; the hidden-test runner imports those from the "
                                 "standard library, so rename them")

    def materialize(self, path: Path) -> Path:
        """Write the repository the agent sees into `path` (created if missing)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        write_files(path, self.files)
        return path

    def run_hidden_tests(self, workspace_path: Path, run: Runner) -> Grade:
        """Run the hidden tests against the tree at `workspace_path` (see the module docstring)."""
        if self.test_command is None:
            from c2jax.tasks.grading import run_hidden_runner
            d = run_hidden_runner(self.hidden_tests, Path(workspace_path), run, self.timeout_s)
            return Grade(bool(d.pop("passed")), float(d.pop("score")), d)
        return self._run_test_command(Path(workspace_path), run)

    def _run_test_command(self, workspace_path: Path, run: Runner) -> Grade:
        """Write the hidden tests (with a fresh nonce), run test_command, remove them."""
        from c2jax.filetree import remove_tree_path, write_tree_files
        nonce = secrets.token_hex(8)
        tops = sorted({Path(p).parts[0] for p in self.hidden_tests} - {Path(p).parts[0] for p in self.files})
        try:
            write_tree_files(workspace_path, {k: v.replace(NONCE_PLACEHOLDER, nonce)
                                              for k, v in self.hidden_tests.items()})
            r = run(list(self.test_command), workspace_path, self.timeout_s)
        finally:
            for rel in self.hidden_tests:
                remove_tree_path(workspace_path, rel)
            for top in tops:
                remove_tree_path(workspace_path, top)
        marker_seen = (PASS_MARKER + nonce) in (r.stdout or "")
        passed = r.returncode == 0 and not r.timed_out and marker_seen
        details = {"returncode": r.returncode, "timed_out": bool(r.timed_out),
                   "marker_seen": marker_seen, "stdout_tail": (r.stdout or "")[-2000:],
                   "stderr_tail": (r.stderr or "")[-2000:]}
        per_test = parse_test_report(r.stdout or "", nonce)
        score = 1.0 if passed else 0.0
        if per_test is not None:
            details["tests"] = per_test
            if per_test and not passed:
                score = sum(v == "pass" for v in per_test.values()) / len(per_test)
                score = min(score, 0.99)
        return Grade(passed, score, details)

    def grade(self, workspace_path: Path, run: Runner, episode: dict | None = None) -> Grade:
        """Grade the final workspace.

        episode (optional; behaviour tasks use it, code tasks ignore it):
          {"final_message": str, "tool_calls": [{"name": str, "arguments": dict}, ...],
           "original_files": dict[str, str]}   # defaults: "", [], self.files
        Call it after the episode, before any other process touches the workspace.
        """
        if self.grader is not None:
            raise TypeError(f"Task {self.task_id} names the behaviour grader {self.grader!r} but is a plain Task; "
                            f"build it as c2jax.tasks.behaviour.BehaviourTask (which runs those checks)")
        if not self.rule_checks:
            return self.run_hidden_tests(workspace_path, run)
        from c2jax.tasks.authoring import RuleContext, run_rule_checks
        episode = episode or {}
        final = snapshot_files(workspace_path)  # before the tests run: they may write files
        ctx = RuleContext(episode.get("original_files") or self.files, final, episode.get("final_message", "") or "",
                          episode.get("tool_calls") or [], self)
        checks = run_rule_checks(self, ctx)
        tests = self.run_hidden_tests(workspace_path, run) if self.hidden_tests else None
        passed = all(c.passed for c in checks) and (tests is None or tests.passed)
        parts = [c.score for c in checks] + ([tests.score] if tests is not None else [])
        score = 1.0 if passed else min(0.99, sum(parts) / len(parts))
        details = {"rule_checks": {c.name: dataclasses.asdict(c) for c in checks}}
        if tests is not None:
            details["hidden_tests"] = {"passed": tests.passed, **tests.details}
        return Grade(passed, score, details)


# Per-test reports: runners may print `C2JAX_REPORT <nonce> <json>` with {test_id: outcome}.
REPORT_MARKER = "C2JAX_REPORT "


def parse_test_report(stdout: str, nonce: str) -> dict[str, str] | None:
    import json
    prefix = REPORT_MARKER + nonce + " "
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            try:
                return json.loads(line[len(prefix):])
            except ValueError:
                return None
    return None


def write_files(root: Path, files: dict[str, str]) -> None:
    root = Path(root)
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)


def snapshot_files(root: Path) -> dict[str, str]:
    """Text of every file under root (relative posix paths), skipping caches and hidden tests;
    links are reported, never followed (c2jax.filetree.read_tree)."""
    from c2jax.filetree import read_tree
    return read_tree(Path(root), IGNORED_PARTS)


class ReferenceError_(ValueError):
    """A reference edit does not apply (old text missing or not unique)."""


def apply_edit_to_files(files: dict[str, str], call: dict) -> dict[str, str]:
    """Apply one edit_file/write_file call to an in-memory file dict (returns a new dict)."""
    name, args = call["name"], call["arguments"]
    files = dict(files)
    if name == "write_file":
        files[args["path"]] = args["content"]
    elif name == "edit_file":
        path, old, new = args["path"], args["old"], args["new"]
        if path not in files:
            raise ReferenceError_(f"edit_file: {path} does not exist")
        count = files[path].count(old)
        if count != 1:
            raise ReferenceError_(f"edit_file: old text occurs {count} times in {path} (need exactly 1)")
        files[path] = files[path].replace(old, new, 1)
    else:
        raise ReferenceError_(f"reference solutions may only use edit_file/write_file, got {name}")
    return files


def apply_reference(task: Task, path: Path) -> None:
    """Replay task.reference_solution onto the repository at `path` (on disk)."""
    path = Path(path)
    for call in task.reference_solution:
        rel = call["arguments"]["path"]
        current = {rel: (path / rel).read_text()} if (path / rel).exists() else {}
        new = apply_edit_to_files(current, call)
        write_files(path, {rel: new[rel]})


def reference_files(task: Task) -> dict[str, str]:
    files = dict(task.files)
    for call in task.reference_solution:
        files = apply_edit_to_files(files, call)
    return files


def diff_line_counts(before: dict[str, str], after: dict[str, str]) -> tuple[int, int]:
    """(added, removed) lines between two file dicts."""
    added = removed = 0
    for path in sorted(set(before) | set(after)):
        a = before.get(path, "").splitlines()
        b = after.get(path, "").splitlines()
        if a == b:
            continue
        for line in difflib.unified_diff(a, b, lineterm="", n=0):
            if line.startswith(("+++", "---", "@@")):
                continue
            if line.startswith("+"):
                added += 1
            elif line.startswith("-"):
                removed += 1
    return added, removed


def lines_changed(task: Task) -> int:
    """Lines added plus lines removed by the reference solution."""
    a, r = diff_line_counts(task.files, reference_files(task))
    return a + r


def minimal_edit(path: str, before: str, after: str) -> dict:
    """An edit_file call turning `before` into `after` whose `old` text is unique in `before`.

    Takes the changed line span and grows it by whole lines until it is unique.
    """
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    ops = [op for op in sm.get_opcodes() if op[0] != "equal"]
    if not ops:
        raise ValueError("minimal_edit: no change")
    i1, i2 = ops[0][1], ops[-1][2]
    j1, j2 = ops[0][3], ops[-1][4]
    while True:
        old = "".join(a[i1:i2])
        if old and before.count(old) == 1:
            return {"name": "edit_file", "arguments": {"path": path, "old": old, "new": "".join(b[j1:j2])}}
        if i1 > 0:
            i1, j1 = i1 - 1, j1 - 1
        elif i2 < len(a):
            i2, j2 = i2 + 1, j2 + 1
        else:  # the whole file: a write is simpler
            return {"name": "write_file", "arguments": {"path": path, "content": after}}


def plain_test_script(body: str) -> str:
    """A hidden plain-python test script for the harness runner: preamble (`_same`), `body`."""
    return HIDDEN_PREAMBLE + "\n" + body.rstrip() + "\n"


def stable_hash(*parts: Any) -> int:
    import hashlib
    h = hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()
    return int(h[:15], 16)


def split_of(fingerprint: str, heldout_fraction: float = 0.2) -> str:
    """Deterministic content-based split: the same content is always in the same split."""
    return "heldout" if (stable_hash("split", fingerprint) % 1000) < heldout_fraction * 1000 else "train"
