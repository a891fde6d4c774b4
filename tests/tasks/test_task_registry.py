"""load_suite registry, suite_stats, and the validate CLI."""
import pytest

from c2jax import tasks as T


def test_names_and_errors():
    assert {"synthetic", "stdlib_bugs", "humaneval", "behaviour"} <= set(T.available_suites())
    with pytest.raises(ValueError, match="unknown task suite"):
        T.load_suite("nope", "train")
    with pytest.raises(ValueError, match="split"):
        T.load_suite("synthetic", "test")
    a = [t.task_id for t in T.load_suite("synthetic:2", "train", n=3)]
    assert a == [t.task_id for t in T.load_suite("synthetic", "train", n=3, level=2)]
    assert all(t.suite == "synthetic:2" for t in T.load_suite("synthetic:2", "train", n=3))


def test_registry_is_open():
    T.register_suite("unit_extra", lambda split, n, seed, **kw: T.load_suite("synthetic:1", split, n, seed))
    assert len(T.load_suite("unit_extra", "train", n=2)) == 2


def test_suite_stats():
    ts = T.load_suite("synthetic:1", "train", n=10) + T.load_suite("humaneval", "train", n=5)
    s = T.suite_stats(ts)
    assert s["synthetic:1"]["n"] == 10 and s["humaneval"]["n"] == 5
    assert s["synthetic:1"]["median_lines_changed"] == 2
    assert 20 < s["synthetic:1"]["median_prompt_chars"] < 120


def test_validate_cli(capsys):
    from c2jax.tasks.validate import main
    assert main(["synthetic:1", "heldout", "3", "1"]) == 0
    out = capsys.readouterr().out
    assert "n=3 valid=3" in out and "median_prompt_chars" in out
