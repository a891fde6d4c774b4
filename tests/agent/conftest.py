import dataclasses
import shutil
from pathlib import Path

import pytest

from c2jax.agent.sandbox import Sandbox, SandboxLimits, unavailable_reason

BWRAP_MISSING = unavailable_reason()


@pytest.fixture(scope="session")
def sandbox():
    if BWRAP_MISSING:
        pytest.skip(BWRAP_MISSING)
    return Sandbox(SandboxLimits(cpu_s=5, memory_mb=256, max_procs=32, file_size_mb=4, wall_s=10,
                                 output_bytes=16_000, tmp_mb=16))


@pytest.fixture
def workdir(tmp_path):
    d = tmp_path / "repo"
    d.mkdir()
    (d / "hello.py").write_text("print('hello')\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@dataclasses.dataclass
class FakeGrade:
    passed: bool
    score: float
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FakeTask:
    """A tiny task in the shape of c2jax.tasks.base.Task: fix add() in calc.py."""

    task_id: str = "fake-add"
    suite: str = "fake"
    split: str = "train"
    prompt: str = "calc.add(2, 3) returns -1; it should return 5. Fix it."
    files: dict = dataclasses.field(default_factory=lambda: {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "README.md": "A calculator.\n"})
    hidden_tests: dict = dataclasses.field(default_factory=lambda: {
        ".c2jax_hidden/test_calc.py": "import sys; sys.path.insert(0, '.')\nimport calc\n"
                                      "assert calc.add(2, 3) == 5\nprint('HIDDEN_OK')\n"})
    reference_solution: list = dataclasses.field(default_factory=lambda: [
        {"name": "edit_file", "arguments": {"path": "calc.py", "old": "a - b", "new": "a + b"}}])
    reference_message: str = "Fixed add."
    system_rules: str | None = None
    interruption: tuple | None = None
    tools: list | None = None

    def grade(self, workspace_path, run, episode=None):
        ws = Path(workspace_path)
        for rel, content in self.hidden_tests.items():
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            (ws / rel).write_text(content)
        try:
            r = run(["python3", ".c2jax_hidden/test_calc.py"], ws, 20)
        finally:
            shutil.rmtree(ws / ".c2jax_hidden", ignore_errors=True)
        ok = r.returncode == 0 and "HIDDEN_OK" in r.stdout
        return FakeGrade(ok, float(ok), {"stdout": r.stdout[-500:], "stderr": r.stderr[-500:],
                                         "episode": episode})


@pytest.fixture
def fake_task():
    return FakeTask()
