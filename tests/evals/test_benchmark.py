import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from c2jax.agent.policy import DoNothingPolicy, OraclePolicy
from c2jax.agent.sandbox import Sandbox, SandboxLimits, unavailable_reason
from c2jax.evals import benchmark as bm

needs_bwrap = pytest.mark.skipif(bool(unavailable_reason()), reason="bubblewrap unavailable")


@given(hs.integers(1, 7), hs.data())
def test_pass_at_k_matches_enumeration(n, data):
    c = data.draw(hs.integers(0, n))
    k = data.draw(hs.integers(1, n))
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert bm.pass_at_k(n, c, k) == pytest.approx(brute)


@dataclasses.dataclass
class Grade:
    passed: bool
    score: float
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class T:
    task_id: str
    suite: str = "s"
    split: str = "heldout"
    prompt: str = "make f return 2"
    files: dict = dataclasses.field(default_factory=lambda: {"f.py": "def f():\n    return 1\n"})
    hidden_tests: dict = dataclasses.field(default_factory=dict)
    reference_solution: list = dataclasses.field(default_factory=lambda: [
        {"name": "edit_file", "arguments": {"path": "f.py", "old": "return 1", "new": "return 2"}}])
    system_rules: str | None = None
    interruption: tuple | None = None
    tools: list | None = None

    def grade(self, path, run, episode=None):
        r = run(["python3", "-c", "import f; assert f.f() == 2"], Path(path), 10)
        return Grade(r.returncode == 0, float(r.returncode == 0))


def test_reference_lines_changed():
    assert bm.reference_lines_changed(T("a")) == 2
    t = T("b", reference_solution=[{"name": "write_file", "arguments": {"path": "g.py", "content": "a\nb\n"}}])
    assert bm.reference_lines_changed(t) == 2


@needs_bwrap
def test_run_benchmark_report(tmp_path):
    sb = Sandbox(SandboxLimits(wall_s=10))
    tasks = {"easy": [T(f"e{i}") for i in range(3)], "other": [T("o0", prompt="x" * 50)]}
    counter = itertools.count()

    def flaky(task):  # every other attempt does nothing
        return OraclePolicy(task) if next(counter) % 2 == 0 else DoNothingPolicy()

    rep = bm.run_benchmark(tasks, flaky, passes=2, sandbox=sb, out_dir=tmp_path, active_params=1e9,
                           concurrency=1, policy_name="flaky")
    s = rep["suites"]["easy"]
    assert s["accuracy"] == pytest.approx(0.5) and s["pass_at_k"]["1"] == pytest.approx(0.5)
    assert s["pass_at_k"]["2"] == pytest.approx(1.0)
    assert s["median_prompt_chars"] == len("make f return 2") and s["median_reference_lines_changed"] == 2
    assert s["inference_flops_per_task"] == pytest.approx(2e9 * s["total_tokens_per_task"])
    assert s["malformed_call_rate"] == 0 and s["tool_calls_per_task"] == pytest.approx(0.5)
    assert rep["suites"]["other"]["median_prompt_chars"] == 50
    md = (tmp_path / "report.md").read_text()
    assert "| easy | 3 | 2 | 0.500 | 0.500 | 1.000 |" in md
    assert json.loads((tmp_path / "report.json").read_text())["tasks"]["easy"][0]["passed"] == [True, False]


@needs_bwrap
def test_main_eval_on_real_suite(tmp_path):
    import ml_collections
    cfg = ml_collections.ConfigDict({"eval": {"suites": ("synthetic:1",), "n_per_suite": 2, "passes": 1,
                                              "concurrency": 2}})
    rep = bm.main_eval(cfg, tmp_path)
    assert rep["suites"]["synthetic:1"]["accuracy"] == 1.0
    assert (tmp_path / "report.md").exists()
    with pytest.raises(ValueError, match="policy_factory"):
        bm.main_eval(ml_collections.ConfigDict({"eval": {"policy": "model"}}), tmp_path, tasks_by_suite={})


def test_grader_exceptions_are_counted_by_type(tmp_path):
    sb = Sandbox(SandboxLimits(wall_s=10))

    class BrokenGrader(T):
        def grade(self, *a, **k):
            raise KeyError("missing field")

    rep = bm.run_benchmark({"broken": [BrokenGrader("b0"), T("ok0")]}, OraclePolicy, passes=1, sandbox=sb,
                           out_dir=tmp_path, concurrency=1)
    s = rep["suites"]["broken"]
    assert s["grader_exceptions"] == 1 and s["grader_exception_types"] == {"KeyError": 1}
    assert s["harness_exceptions"] == 0 and s["truncated_turns"] == 0
    assert "grader exceptions by type: KeyError x1" in (tmp_path / "report.md").read_text()
