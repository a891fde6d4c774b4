"""HumanEval as repository tasks."""
import pytest

from c2jax.tasks import load_suite, validate_task


def test_ships_all_problems_with_disjoint_splits():
    train = load_suite("humaneval", "train")
    held = load_suite("humaneval", "heldout")
    assert len(train) + len(held) == 164
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    assert 20 <= len(held) <= 45


def test_deterministic_and_seeded_order():
    a = [t.task_id for t in load_suite("humaneval", "train", n=10, seed=1)]
    assert a == [t.task_id for t in load_suite("humaneval", "train", n=10, seed=1)]
    assert a != [t.task_id for t in load_suite("humaneval", "train", n=10, seed=0)]


def test_sample_validates():
    tasks = load_suite("humaneval", "train", n=4, seed=2) + load_suite("humaneval", "heldout", n=3, seed=2)
    for t in tasks:
        assert set(t.files) == {"solution.py"}
        assert t.reference_solution[0]["name"] == "write_file"
        r = validate_task(t)
        assert r.ok, (t.task_id, r.problems)


@pytest.mark.parametrize("tid,edit", [
    # `from solution import *` may not bind a builtin the check uses (abs -> 0 would pass it)
    ("humaneval-4", lambda src: src + "\n    return 0.0\n\n__all__ = ['mean_absolute_deviation', 'abs']\n\n\n"
                                      "def abs(x):\n    return 0\n"),
    # the check's helpers are the prompt's own, not the solution's (poly -> 0 would pass it)
    ("humaneval-32", lambda src: src.replace("return sum([coeff * math.pow(x, i) for i, coeff in enumerate(xs)])",
                                             "return 0") + "\n    return 0.0\n"),
])
def test_checks_use_trusted_helpers(tid, edit, tmp_path):
    from c2jax.tasks import humaneval, local_run
    from c2jax.tasks.base import write_files
    task = next(t for t in humaneval.load("train") + humaneval.load("heldout") if t.task_id == tid)
    src = edit(task.files["solution.py"])
    assert src != task.files["solution.py"] + "\n    return 0.0\n"
    write_files(tmp_path, {"solution.py": src})
    assert not task.grade(tmp_path, local_run).passed
