"""Synthetic repositories: determinism, level shapes, validation, disjoint splits."""
import dataclasses

import pytest

from c2jax.tasks import lines_changed, load_suite, validate_task
from c2jax.tasks.synthetic import load


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deterministic_by_seed(level):
    a = [dataclasses.asdict(t) for t in load("train", 12, seed=3, level=level)]
    b = [dataclasses.asdict(t) for t in load("train", 12, seed=3, level=level)]
    c = [t["task_id"] for t in (dataclasses.asdict(t) for t in load("train", 12, seed=4, level=level))]
    assert a == b
    assert [t["task_id"] for t in a] != c
    assert [t["task_id"] for t in a[:5]] == [t.task_id for t in load("train", 5, seed=3, level=level)]


def test_level1_is_tiny_and_names_the_file():
    for t in load("train", 50, level=1):
        (path, src), = t.files.items()
        assert len(src.splitlines()) <= 10, src
        assert path in t.prompt
        assert lines_changed(t) == 2  # one line replaced
        assert len(t.prompt) < 120
        assert t.metadata["bug_file"] == path


def test_level2_bug_is_not_in_the_named_file():
    for t in load("train", 30, level=2):
        assert 2 <= len([p for p in t.files if not p.endswith("__init__.py")]) <= 4
        assert t.metadata["named_file"] in t.prompt
        assert all(b != t.metadata["named_file"] for b in t.metadata["bug_files"])
        assert not any(b in t.prompt for b in t.metadata["bug_files"])


def test_level3_has_two_problems():
    variants = set()
    for t in load("train", 30, level=3):
        variants.add(t.metadata["variant"])
        if t.metadata["variant"] == "two_bugs":
            assert len({e["arguments"]["path"] for e in t.reference_solution}) == 2
        else:
            assert t.metadata["variant"] == "bug_and_missing_function"
    assert variants == {"two_bugs", "bug_and_missing_function"}


@pytest.mark.parametrize("name", ["synthetic:1", "synthetic:2", "synthetic:3"])
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_sample_validates(name, split):
    for t in load_suite(name, split, n=4, seed=7):
        r = validate_task(t)
        assert r.ok, (t.task_id, r.problems)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_splits_disjoint(level):
    train = load("train", 100, seed=0, level=level) + load("train", 50, seed=1, level=level)
    held = load("heldout", 30, seed=0, level=level) + load("heldout", 20, seed=1, level=level)
    assert all(t.split == "train" for t in train) and all(t.split == "heldout" for t in held)
    key = lambda t: (t.prompt, tuple(sorted(t.files.items())))
    assert not {key(t) for t in train} & {key(t) for t in held}
    assert not {t.task_id for t in train} & {t.task_id for t in held}
