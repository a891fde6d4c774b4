"""Task record, reference application, grading protocols (harness runner; legacy command)."""
from pathlib import Path

import pytest

from c2jax.tasks import Task, apply_reference, local_run, snapshot_files
from c2jax.tasks.base import HIDDEN_DIR, minimal_edit, plain_test_script


def _task(**kw):
    body = "from calc import add\nassert add(2, 3) == 5\n"
    d = {"task_id": "t", "suite": "unit", "split": "train", "prompt": "add(2, 3) returns -1. Fix it.",
         "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
         "hidden_tests": {f"{HIDDEN_DIR}/test_h.py": plain_test_script(body)},
         "test_command": None,
         "reference_solution": [{"name": "edit_file", "arguments": {
             "path": "calc.py", "old": "a - b", "new": "a + b"}}]}
    d.update(kw)
    return Task(**d)


def test_reference_passes_and_hidden_files_are_removed(tmp_path):
    t = _task()
    t.materialize(tmp_path)
    assert not t.grade(tmp_path, local_run).passed
    apply_reference(t, tmp_path)
    g = t.grade(tmp_path, local_run)
    assert g.passed and g.score == 1.0, g.details
    assert not (tmp_path / HIDDEN_DIR).exists()
    assert set(snapshot_files(tmp_path)) == {"calc.py"}


def test_legacy_test_command_writes_and_removes_hidden_files(tmp_path):
    body = ("import sys\nsys.path.insert(0, '.')\nfrom calc import add\nassert add(2, 3) == 5\n"
            "print('C2JAX_ALL_PASSED ' + '__C2JAX_NONCE__')\n")
    t = _task(hidden_tests={"grading/check.py": body}, test_command=["python3", "grading/check.py"])
    t.materialize(tmp_path)
    assert not t.grade(tmp_path, local_run).passed
    apply_reference(t, tmp_path)
    assert t.grade(tmp_path, local_run).passed
    assert set(snapshot_files(tmp_path)) == {"calc.py"}


@pytest.mark.parametrize("cheat", [
    "import sys\nsys.exit(0)\n",                              # exit 0 before the checks run
    "print('C2JAX_ALL_PASSED __C2JAX_NONCE__')\nimport os\nos._exit(0)\n",  # fake marker
])
def test_spoofed_success_fails(tmp_path, cheat):
    t = _task()
    t.materialize(tmp_path)
    (tmp_path / "calc.py").write_text(cheat + "def add(a, b):\n    return a - b\n")
    assert not t.grade(tmp_path, local_run).passed


def test_timeout_fails(tmp_path):
    t = _task(timeout_s=2.0)
    t.materialize(tmp_path)
    (tmp_path / "calc.py").write_text("while True:\n    pass\n")
    g = t.grade(tmp_path, local_run)
    assert not g.passed
    assert g.details["timed_out"] or "TimeoutError" in str(g.details["errors"]), g.details


def test_reference_must_match_exactly_once(tmp_path):
    t = _task(files={"calc.py": "x = a - b\ny = a - b\n"})
    t.materialize(tmp_path)
    with pytest.raises(ValueError, match="2 times"):
        apply_reference(t, tmp_path)


def test_bad_paths_rejected():
    with pytest.raises(ValueError, match="relative"):
        _task(files={"../evil.py": ""})
    with pytest.raises(ValueError, match="split"):
        _task(split="test")
    with pytest.raises(ValueError, match="not valid Python"):
        _task(hidden_tests={"tests/hidden_x.py": "def ("})
    with pytest.raises(ValueError, match="also repository files"):
        _task(hidden_tests={"calc.py": ""})
    with pytest.raises(ValueError, match="standard-library"):
        _task(files={"json/__init__.py": "", "calc.py": ""}, hidden_tests={"h.py": "import json.decoder\n"})
    _task(files={"test/test_calc.py": "", "calc.py": ""})  # a stdlib name the hidden tests do not import
    with pytest.raises(ValueError, match="nothing to grade"):
        _task(hidden_tests={})


def test_minimal_edit_is_unique_and_roundtrips():
    before = "a = 1\nb = 2\na = 1\nc = 3\n"
    after = "a = 1\nb = 2\na = 2\nc = 3\n"
    e = minimal_edit("f.py", before, after)
    old, new = e["arguments"]["old"], e["arguments"]["new"]
    assert before.count(old) == 1 and before.replace(old, new) == after
    assert Path  # keep import used


def test_always_equal_object_does_not_pass(tmp_path):
    from c2jax.tasks import load_suite
    t = load_suite("synthetic:1", "train", n=1)[0]
    t.materialize(tmp_path)
    fn = t.metadata["bug_function"]
    (tmp_path / t.metadata["bug_file"]).write_text(
        "class _Eq:\n    def __eq__(self, other):\n        return True\n\n\n"
        f"def {fn}(*args):\n    return _Eq()\n")
    assert not t.grade(tmp_path, local_run).passed
