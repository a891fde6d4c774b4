"""HumanEval as repository tasks."""
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
