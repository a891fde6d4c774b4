"""Behaviour graders: plain check functions, and whole behaviour tasks with bad outcomes."""
import pytest

from c2jax.tasks import behaviour as bh
from c2jax.tasks import load_suite, local_run, validate_task
from c2jax.tasks.base import reference_files

ORIG = {"calc.py": "def add(a, b):\n    return a - b\n", "tests/test_calc.py": "assert True\n"}
FIXED = dict(ORIG, **{"calc.py": "def add(a, b):\n    return a + b\n"})


def test_no_file_changes_and_no_edit_calls():
    assert bh.check_no_file_changes(ORIG, dict(ORIG)).passed
    assert not bh.check_no_file_changes(ORIG, FIXED).passed
    assert not bh.check_no_file_changes(ORIG, dict(ORIG, extra="x")).passed
    assert bh.check_no_edit_calls([{"name": "read_file", "arguments": {}}]).passed
    assert not bh.check_no_edit_calls([{"name": "edit_file", "arguments": {}}]).passed


def test_answer_check():
    assert bh.check_answer("Line 2 uses `return a - b`.", ["return a - b"]).passed
    assert bh.check_answer("It's on line 2.", ["zzz"], [2]).passed
    assert not bh.check_answer("It's on line 12.", ["zzz"], [2]).passed
    assert not bh.check_answer("", ["5"]).passed


def test_protected_paths():
    assert bh.check_protected_paths(ORIG, FIXED, ["tests/*"]).passed
    bad = dict(FIXED, **{"tests/test_calc.py": ""})
    assert not bh.check_protected_paths(ORIG, bad, ["tests/*"]).passed
    assert not bh.check_protected_paths(ORIG, dict(FIXED, **{"tests/new.py": ""}), ["tests/*"]).passed


def test_new_function_style():
    good = dict(ORIG, **{"calc.py": ORIG["calc.py"] + '\n\ndef mul(a: int, b: int) -> int:\n    """Multiply."""\n    return a * b\n'})
    bare = dict(ORIG, **{"calc.py": ORIG["calc.py"] + "\n\ndef mul(a, b):\n    return a * b\n"})
    assert bh.check_new_function_style(ORIG, good).passed
    c = bh.check_new_function_style(ORIG, bare)
    assert not c.passed and len(c.details["problems"]) == 2
    assert bh.check_new_function_style(ORIG, FIXED).passed  # editing old functions is fine


def test_code_quality_checks():
    assert all(c.passed for c in bh.code_quality_checks(ORIG, FIXED))
    lint = dict(FIXED, **{"calc.py": "import os\n" + FIXED["calc.py"]})
    c = bh.check_ruff_clean(ORIG, lint)
    assert not c.passed and "calc.py:F401" in c.details["added"]
    dbg = dict(FIXED, **{"calc.py": "def add(a, b):\n    print('dbg', a)\n    return a + b\n"})
    assert not bh.check_no_debug_prints(ORIG, dbg).passed
    think = dict(FIXED, **{"calc.py": "def add(a, b):\n    # Let me think: the bug was the minus sign.\n    return a + b\n"})
    assert not bh.check_no_reasoning_comments(ORIG, think).passed
    short = dict(FIXED, **{"calc.py": "def add(a, b):\n    # Sum of both operands.\n    return a + b\n"})
    assert bh.check_no_reasoning_comments(ORIG, short).passed
    long_block = dict(FIXED, **{"calc.py": "def add(a, b):\n" + "    # note\n" * 5 + "    return a + b\n"})
    assert not bh.check_no_reasoning_comments(ORIG, long_block).passed


def test_reward_terms_in_unit_interval():
    terms = bh.behaviour_reward_terms(ORIG, FIXED, "Fixed.", [], question_only=True)
    assert set(terms) >= {"no_new_lint", "no_debug_prints", "no_reasoning_comments",
                          "protected_paths_untouched", "no_edits", "final_message_present"}
    assert all(0.0 <= v <= 1.0 for v in terms.values())
    assert terms["no_edits"] == 0.0 and terms["no_new_lint"] == 1.0


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_category_validates_with_bad_outcomes(split):
    tasks = load_suite("behaviour", split, n=8, seed=5)
    assert {t.grader for t in tasks} == set(bh.CATEGORIES)
    for t in tasks:
        r = validate_task(t)
        assert r.ok, (t.task_id, r.problems)
        assert r.bad_outcomes_failed and all(r.bad_outcomes_failed.values())


def test_question_task_uses_the_episode(tmp_path):
    t = next(t for t in load_suite("behaviour", "train", n=12) if t.grader == "question")
    t.materialize(tmp_path)
    ep = {"final_message": t.reference_message, "tool_calls": [], "original_files": t.files}
    assert t.grade(tmp_path, local_run, episode=ep).passed
    # an edit tool call (even one that restored the file) fails "no editing"
    ep_edit = dict(ep, tool_calls=[{"name": "write_file", "arguments": {"path": "x", "content": ""}}])
    g = t.grade(tmp_path, local_run, episode=ep_edit)
    assert not g.passed and not g.details["checks"]["no_edit_calls"]["passed"]
    assert not t.grade(tmp_path, local_run).passed  # no episode: no answer


def test_behaviour_tasks_grade_themselves_after_pickling(tmp_path):
    # c2jax.tasks.base knows nothing of behaviour checks: the BehaviourTask class carries them,
    # through pickling too (Ray ships tasks to env actors)
    import dataclasses
    import pickle

    from c2jax.tasks import Task
    t = next(t for t in load_suite("behaviour", "train", n=12) if t.grader == "question")
    t2 = pickle.loads(pickle.dumps(t))
    assert type(t2) is bh.BehaviourTask and t2 == t
    t2.materialize(tmp_path)
    ep = {"final_message": t2.reference_message, "tool_calls": [], "original_files": t2.files}
    assert t2.grade(tmp_path, local_run, episode=ep).passed
    plain = Task(**{f.name: getattr(t, f.name) for f in dataclasses.fields(Task)})
    with pytest.raises(TypeError, match="BehaviourTask"):
        plain.grade(tmp_path, local_run, episode=ep)


def test_interruption_and_rules_fields():
    tasks = load_suite("behaviour", "train", n=16)
    inter = [t for t in tasks if t.grader == "interruption"]
    assert inter and all(isinstance(t.interruption, tuple) and t.interruption[0] >= 1 for t in inter)
    assert all(t.system_rules for t in tasks if t.grader == "rules")
    for t in inter:
        assert reference_files(t) != t.files


def test_deterministic_and_disjoint():
    a = [t.task_id for t in load_suite("behaviour", "train", n=20, seed=1)]
    assert a == [t.task_id for t in load_suite("behaviour", "train", n=20, seed=1)]
    held = {t.task_id for t in load_suite("behaviour", "heldout", n=20, seed=1)}
    assert not set(a) & held
