"""Grading a task's hidden tests with the harness's runner (c2jax.tasks.hidden_runner).

The grader starts the runner in the task tree through the caller's `run` (the sandbox), feeds
it a fresh HMAC key, a fresh run id and the hidden test sources on stdin, and trusts only a
result line signed with that key, for that run, naming exactly the expected test ids. The
threat model is in c2jax.tasks.hidden_runner's docstring.
"""
from __future__ import annotations

import ast
import hashlib
import hmac
import json
import secrets
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from c2jax.tasks import hidden_runner

RUNNER_ARGV_PREFIX = ("python3", "-I", "-S", "-c")


@lru_cache(maxsize=1)
def runner_source() -> str:
    """The runner script as passed to `python3 -c` (it carries its own text for its workers)."""
    text = Path(hidden_runner.__file__).read_text()
    return f"_SOURCE_TEXT = {text!r}\n" + text


def expected_test_ids(hidden_tests: dict[str, str]) -> list[str]:
    """Test ids the runner must report: `path::test_fn` for files defining test_* functions, else
    the file's path. Computed here, from the task, never from what ran."""
    ids: list[str] = []
    for path, src in sorted(hidden_tests.items()):
        try:
            tree = ast.parse(src)
        except SyntaxError as e:
            raise ValueError(f"hidden test {path!r} is not valid Python: {e}") from None
        fns = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name.startswith("test_")]
        ids += [f"{path}::{n}" for n in fns] or [path]
    return ids


def stdlib_shadows(files: dict[str, str], hidden_tests: dict[str, str]) -> list[str]:
    """Top-level names the hidden tests import that are both a task module and a stdlib module."""
    tops = {Path(p).parts[0].removesuffix(".py") for p in files if p.endswith(".py") or len(Path(p).parts) > 1}
    imported: set[str] = set()
    for src in hidden_tests.values():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    return sorted(tops & imported & set(sys.stdlib_module_names))


def verify_result(stdout: str, key: bytes, run_id: str, expected: list[str] | None) -> dict[str, Any]:
    """Checks the runner's signed record: {"passed", "score", "tests", "checks", "problem", ...}.

    A record that lists guard violations (c2jax.tasks.stdlib_runner) never passes. expected None
    (test discovery, trusted code only): the reported ids are taken as expected."""
    record = None
    for line in (stdout or "").splitlines():
        if not line.startswith(hidden_runner.RESULT_PREFIX):
            continue
        parts = line[len(hidden_runner.RESULT_PREFIX):].split(" ", 1)
        if len(parts) != 2:
            continue
        want = hmac.new(key, parts[1].encode(), hashlib.sha256).hexdigest()
        if hmac.compare_digest(parts[0], want):
            try:
                record = json.loads(parts[1])
            except ValueError:
                record = None
            break
    out: dict[str, Any] = {"passed": False, "score": 0.0, "tests": {}, "checks": {}, "problem": "",
                           "errors": {}, "raw": {}, "violations": [], "shadow_ok": False}
    if not isinstance(record, dict):
        out["problem"] = "no signed result from the test runner"
        return out
    if record.get("run") != run_id or record.get("complete") is not True:
        out["problem"] = "result record of another run, or incomplete"
        return out
    tests = {str(k): (v.get("outcome") if isinstance(v, dict) else "fail") for k, v in
             (record.get("tests") or {}).items()}
    errors = {str(k): v.get("error", "") for k, v in (record.get("tests") or {}).items()
              if isinstance(v, dict) and v.get("error")}
    checks = {str(k): str(v) for k, v in (record.get("checks") or {}).items()}
    raw = {str(k): str(v.get("raw", v.get("outcome"))) for k, v in (record.get("tests") or {}).items()
           if isinstance(v, dict)}
    violations = [str(v) for v in (record.get("violations") or [])]
    out.update(tests=tests, checks=checks, errors=errors, raw=raw, violations=violations,
               shadow_ok=record.get("shadow_ok", True) is True)
    if expected is None:
        expected = sorted(tests)
    if violations:
        out["problem"] = "the code under test tripped the grader's guard: " + "; ".join(violations[:5])
        return out
    if set(tests) != set(expected):
        out["problem"] = (f"reported tests differ from the expected ones: missing "
                          f"{sorted(set(expected) - set(tests))[:5]}, unexpected {sorted(set(tests) - set(expected))[:5]}")
        return out
    passed = bool(expected) and all(tests[t] == "pass" for t in expected)
    out["passed"] = passed
    if passed:
        out["score"] = 1.0
    else:
        parts = checks or tests
        out["score"] = min(0.99, sum(v == "pass" for v in parts.values()) / max(1, len(parts)))
    return out


def run_signed_runner(argv: list[str], payload: dict, workspace_path: Path, run, timeout_s: float,
                      expected: list[str] | None) -> dict[str, Any]:
    """Starts a runner that reads `payload` plus a fresh key and run id on stdin and answers with
    one signed record; returns verify_result's dict plus the run's returncode / timed_out /
    stderr tail (a timed-out run never passes)."""
    key, run_id = secrets.token_bytes(32), secrets.token_hex(16)
    stdin = json.dumps({"key": key.hex(), "run": run_id, **payload})
    r = run(argv, Path(workspace_path), timeout_s, stdin=stdin)
    out = verify_result(r.stdout or "", key, run_id, expected)
    out.update(returncode=r.returncode, timed_out=bool(getattr(r, "timed_out", False)),
               stderr_tail=(r.stderr or "")[-2000:])
    if out["timed_out"]:
        out["passed"], out["score"] = False, min(out["score"], 0.99)
    return out


def run_hidden_runner(hidden_tests: dict[str, str], workspace_path: Path, run, timeout_s: float) -> dict[str, Any]:
    """Runs `hidden_tests` in the task tree with the harness runner; returns run_signed_runner's dict."""
    payload = {"tests": dict(hidden_tests), "timeout_s": max(1.0, float(timeout_s) - 2.0)}
    return run_signed_runner([*RUNNER_ARGV_PREFIX, runner_source(), "run"], payload, workspace_path, run,
                             timeout_s, expected_test_ids(hidden_tests))
