"""A task set written outside the package (bugfix, feature, question, instruction), with its
own hidden-test layout, regex and function answers and rule checks: it loads by module path,
validates, and runs through `python -m c2jax eval`: the oracle passes all, doing nothing none."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from c2jax.tasks import load_suite, local_run, validate_task
from c2jax.tasks.base import apply_edit_to_files, write_files

ROOT = Path(__file__).resolve().parents[2]

ACME = textwrap.dedent('''
    """acme_tasks: twelve tasks of four kinds, hidden tests under grading/<kind>/."""
    import re

    from c2jax.tasks.base import Task
    from c2jax.tasks.behaviour import BehaviourTask


    def changelog_updated(ctx):
        """Every change adds a line to CHANGELOG.md."""
        before = ctx.original_files.get("CHANGELOG.md", "").splitlines()
        after = ctx.final_files.get("CHANGELOG.md", "").splitlines()
        return len(after) > len(before), {"lines_added": len(after) - len(before)}


    def no_print_calls(ctx):
        """No changed Python file calls print()."""
        changed = [p for p in ctx.changed_paths() if p.endswith(".py")]
        bad = [p for p in changed if re.search(r"\\bprint\\(", ctx.final_files.get(p, ""))]
        return not bad, {"files": bad}


    def answer_is_port(message, task):
        """The first number in the answer is the port."""
        m = re.search(r"\\b(\\d{2,5})\\b", message)
        return bool(m) and int(m.group(1)) == task.metadata["port"]


    def _edit(path, old, new):
        return {"name": "edit_file", "arguments": {"path": path, "old": old, "new": new}}


    def bugfix(i):
        pct = 10 + 5 * i
        files = {"pricing/__init__.py": "", "pricing/discount.py":
                 "def apply(price, pct):\\n    return round(price * (1 + pct / 100), 2)\\n"}
        tests = {f"grading/bugfix/test_discount_{i}.py":
                 "from pricing.discount import apply\\n\\n\\n"
                 f"def test_discount():\\n    assert apply(200.0, {pct}) == {round(200 * (1 - pct / 100), 2)}\\n\\n\\n"
                 "def test_no_discount():\\n    assert apply(50.0, 0) == 50.0\\n"}
        return Task(task_id=f"acme-bugfix-{i}", suite="acme", split="train",
                    prompt=f"apply(200, {pct}) raises the price; a discount must lower it. Fix it.",
                    files=files, hidden_tests=tests, test_command=None,
                    reference_solution=[_edit("pricing/discount.py", "1 + pct", "1 - pct")])


    FEATURES = [("word_count", "len(text.split())", "'a b  c'", 3),
                ("line_count", "len(text.splitlines())", "'x\\\\ny\\\\n'", 2),
                ("vowel_count", "sum(c in 'aeiou' for c in text.lower())", "'Banana'", 3)]


    def feature(i):
        name, body, arg, want = FEATURES[i]
        files = {"textutil.py": "def shout(text):\\n    return text.upper()\\n"}
        tests = {f"grading/feature/check_{name}.py":
                 f"from textutil import {name}, shout\\n\\nassert {name}({arg}) == {want}\\n"
                 f"assert {name}('') == 0\\nassert shout('a') == 'A'\\n"}
        new = f"def shout(text):\\n    return text.upper()\\n\\n\\ndef {name}(text):\\n    return {body}\\n"
        return Task(task_id=f"acme-feature-{i}", suite="acme", split="train",
                    prompt=f"Add {name}(text) to textutil.py (0 for empty text).", files=files,
                    hidden_tests=tests, test_command=None,
                    reference_solution=[{"name": "write_file", "arguments": {"path": "textutil.py", "content": new}}])


    def question(i):
        port = 8000 + 7 * i
        answers = [{"answer_patterns": [rf"\\bport\\s*{port}\\b", rf"\\b{port}\\b"]},
                   {"answer_grader": "acme_tasks:answer_is_port"},
                   {"answer_patterns": [rf"^{port}$"], "answer_grader": answer_is_port}][i]
        files = {"server.py": f"import os\\n\\nPORT = int(os.environ.get('PORT', {port}))\\n"}
        return BehaviourTask(task_id=f"acme-question-{i}", suite="acme", split="train",
                             prompt="Which port does the server listen on by default? Do not change anything.",
                             files=files, hidden_tests={}, test_command=None, reference_solution=[],
                             reference_message=f"{port}" if i == 2 else f"It listens on port {port}.",
                             grader="question", metadata={"port": port, "behaviour": answers})


    def instruction(i):
        who = ["world", "team", "reader"][i]
        files = {"greet.py": "def greet(name):\\n    raise NotImplementedError\\n", "CHANGELOG.md": "# Changes\\n"}
        tests = {f"grading/instruction/{i}/test_greet.py":
                 f"from greet import greet\\n\\n\\ndef test_greet():\\n    assert greet({who!r}) == 'Hello, {who}!'\\n"}
        return Task(task_id=f"acme-instruction-{i}", suite="acme", split="train",
                    prompt="Implement greet(name): it returns 'Hello, <name>!'.", files=files,
                    hidden_tests=tests, test_command=None,
                    system_rules="Record every change in CHANGELOG.md. Never add print calls.",
                    rule_checks=("acme_tasks:changelog_updated", no_print_calls),
                    reference_solution=[_edit("greet.py", "raise NotImplementedError", "return f'Hello, {name}!'"),
                                        _edit("CHANGELOG.md", "# Changes\\n", "# Changes\\n- greet() implemented\\n")])


    def load(split, n=None, seed=0):
        tasks = [make(i) for make in (bugfix, feature, question, instruction) for i in range(3)]
        tasks = [t for t in tasks if t.split == split]
        return tasks if n is None else tasks[:n]
''')


@pytest.fixture
def acme(tmp_path, monkeypatch):
    d = tmp_path / "outside"
    d.mkdir()
    (d / "acme_tasks.py").write_text(ACME)
    monkeypatch.syspath_prepend(str(d))
    sys.modules.pop("acme_tasks", None)
    yield d
    sys.modules.pop("acme_tasks", None)


def _env(extra: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{extra}{os.pathsep}{ROOT}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_outside_tasks_load_and_validate(acme):
    tasks = load_suite("acme_tasks:load", "train")
    assert len(tasks) == 12
    assert {t.task_id.split("-")[1] for t in tasks} == {"bugfix", "feature", "question", "instruction"}
    assert load_suite("acme_tasks:load", "heldout") == []
    for t in tasks:
        r = validate_task(t)
        assert r.ok, (t.task_id, r.problems)
    r = subprocess.run([sys.executable, "-m", "c2jax.tasks.validate", "acme_tasks:load", "train"], cwd=ROOT,
                       env=_env(acme), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "n=12 valid=12" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_rule_checks_answers_and_partial_credit(acme, tmp_path):
    tasks = {t.task_id: t for t in load_suite("acme_tasks:load", "train")}

    def grade(task, calls, message=""):
        files = dict(task.files)
        for c in calls:
            files = apply_edit_to_files(files, c)
        d = tmp_path / f"g{len(list(tmp_path.iterdir()))}"
        write_files(d, files)
        return task.grade(d, local_run, {"final_message": message, "tool_calls": calls, "original_files": task.files})

    inst = tasks["acme-instruction-0"]
    no_log = grade(inst, inst.reference_solution[:1])
    assert not no_log.passed and not no_log.details["rule_checks"]["changelog_updated"]["passed"]
    assert no_log.details["hidden_tests"]["passed"]
    printing = [{"name": "edit_file", "arguments": {"path": "greet.py", "old": "raise NotImplementedError",
                                                    "new": "print(name)\n    return f'Hello, {name}!'"}},
                inst.reference_solution[1]]
    assert not grade(inst, printing).passed
    q = tasks["acme-question-1"]
    assert grade(q, [], "Port 8007, set in server.py.").passed
    assert not grade(q, [], "Port 8000.").passed
    q2 = tasks["acme-question-2"]  # the pattern ^8014$ or the grader: either accepts
    assert grade(q2, [], "8014").passed and grade(q2, [], "It is 8014.").passed
    assert not grade(q2, [], "8000 or 8014").passed
    half = grade(tasks["acme-bugfix-0"], [])
    assert not half.passed and 0 < half.score < 1 and half.details["tests"] == {
        "grading/bugfix/test_discount_0.py::test_discount": "fail",
        "grading/bugfix/test_discount_0.py::test_no_discount": "pass"}


def test_unknown_outside_suites_fail_clearly(acme):
    with pytest.raises(ValueError, match="cannot import module"):
        load_suite("no_such_pkg.tasks:load", "train")
    with pytest.raises(ValueError, match="no loader function"):
        load_suite("acme_tasks:nope", "train")


@pytest.mark.parametrize("policy,accuracy", [("oracle", 1.0), ("do_nothing", 0.0)])
def test_outside_tasks_run_through_the_eval_cli(acme, tmp_path, policy, accuracy):
    out = tmp_path / f"eval_{policy}"
    r = subprocess.run([sys.executable, "-m", "c2jax", "eval", "--workdir", str(out),
                        "--config.eval.suites=('acme_tasks:load',)", "--config.eval.split=train",
                        "--config.eval.n_per_suite=0", "--config.eval.passes=1", f"--config.eval.policy={policy}",
                        "--config.eval.concurrency=4"],
                       cwd=ROOT, env=_env(acme), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    s = rep["suites"]["acme_tasks:load"]
    assert s["tasks"] == 12 and s["accuracy"] == accuracy and s["grader_exceptions"] == 0


def test_outside_suite_loads_by_entry_point(acme):
    # an installed distribution declaring the suite in the "c2jax.task_suites" group
    dist = acme / "acme_tasks-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tasks\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[c2jax.task_suites]\nacme = acme_tasks:load\n")
    code = ("from c2jax.tasks import available_suites, load_suite\n"
            "assert 'acme' in available_suites(), available_suites()\n"
            "print('loaded', len(load_suite('acme', 'train', n=3)))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(acme), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "loaded 3" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "c2jax.tasks.validate", "acme", "train", "4"], cwd=ROOT,
                       env=_env(acme), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "n=4 valid=4" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
