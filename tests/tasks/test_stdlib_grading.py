"""The stdlib-bug grader against forged passes: the run-time guard and the static containment
check each stop every known attack on their own; honest fixes pass both."""
import dataclasses
import tempfile
from pathlib import Path

import pytest

from c2jax.agent.sandbox import Sandbox
from c2jax.agent.workspace import Workspace, write_tree_files
from c2jax.tasks import attacks as atk
from c2jax.tasks import load_suite
from c2jax.tasks import stdlib_bugs as sb
from c2jax.tasks.base import apply_edit_to_files, local_run, reference_files
from c2jax.tasks.containment import containment_violations


@pytest.fixture(scope="module")
def task(stdlib_cache):
    return load_suite("stdlib_bugs", "train", n=1, modules=("textwrap",))[0]


def _module(task):
    return task.metadata["module"] + ".py"


def _run_time_only(task, source):
    """Runs the grader's runner on `source` without the static check (on this host)."""
    mod = task.metadata["module"]
    with tempfile.TemporaryDirectory() as d:
        Path(d, _module(task)).write_text(source)
        payload = sb.run_payload(mod, task.hidden_tests[f".c2jax_hidden/test_{mod}.py"], task.expected_tests,
                                 [task.original_source, task.files[_module(task)]])
        return sb.run_stdlib_runner(payload, Path(d), local_run, 30.0, list(task.expected_tests))


def test_attack_list_is_big_enough():
    assert len(atk.IN_PROCESS) >= 12


def test_runner_reference_passes_and_bug_fails(task):
    good = _run_time_only(task, task.original_source)
    assert good["passed"] and good["score"] == 1.0 and not good["violations"], good["problem"]
    bad = _run_time_only(task, task.files[_module(task)])
    assert not bad["passed"] and not bad["violations"] and bad["score"] < 1.0
    assert set(bad["tests"]) == set(task.expected_tests)


@pytest.mark.parametrize("name", sorted(atk.IN_PROCESS))
def test_in_process_attacks_are_caught_at_run_time(task, name):
    # appended to the *fixed* module: the tests alone would pass, so only the guard or the
    # protocol can make these fail
    r = _run_time_only(task, atk.in_process_attack_source(task.original_source, name))
    assert not r["passed"] and r["score"] == 0.0
    assert r["violations"] or r["problem"] == "no signed result from the test runner", r["problem"]


@pytest.mark.parametrize("name", sorted(atk.IN_PROCESS))
def test_in_process_attacks_are_caught_before_running(task, name):
    src = atk.in_process_attack_source(task.original_source, name)
    assert containment_violations(src, [task.original_source, task.files[_module(task)]])


def test_containment_allows_honest_fixes(task):
    originals = [task.original_source, task.files[_module(task)]]
    assert containment_violations(task.original_source, originals) == []
    assert containment_violations(task.files[_module(task)], originals) == []
    helper = task.original_source + "\n\ndef _count_words(text):\n    words = text.split()\n    return len(words)\n"
    assert containment_violations(helper, originals) == []
    assert containment_violations("def broken(:\n", originals) == ["not valid Python: SyntaxError"]
    assert containment_violations("import os\n" + task.original_source, originals) == ["import os: 1 > 0"]


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox()


def _grade(task, files, sandbox):
    ws = Workspace.create(task, sandbox=sandbox)
    try:
        write_tree_files(ws.path, {p: c for p, c in files.items() if task.files.get(p) != c})
        return task.grade(ws.path, sandbox.run, {"original_files": task.files})
    finally:
        ws.cleanup()


def test_every_known_attack_fails_in_the_sandbox(task, sandbox):
    task = dataclasses.replace(task, timeout_s=20.0)
    assert _grade(task, reference_files(task), sandbox).passed
    unsolved = _grade(task, dict(task.files), sandbox)
    assert not unsolved.passed and 0 < unsolved.score < 1
    passed = []
    names = atk.all_forged_pass_attacks()
    for name in names:
        files = dict(task.files)
        for call in atk.forged_pass_edits(task, name):
            files = apply_edit_to_files(files, call)
        if _grade(task, files, sandbox).passed:
            passed.append(name)
    for name in sorted(atk.IN_PROCESS):
        src = atk.in_process_attack_source(task.files[_module(task)], name)
        if _grade(task, {**task.files, _module(task): src}, sandbox).passed:
            passed.append(name)
    assert passed == []
