"""The harness's hidden-test runner: test ids, values across the boundary, partial credit."""
from c2jax.tasks.base import local_run, write_files
from c2jax.tasks.grading import expected_test_ids, run_hidden_runner

CODE = '''class Counter:
    def __init__(self):
        self.value = 0
        self.step = 1

    def inc(self):
        self.value += self.step
        return self


class Oops(Exception):
    pass


def parse(s):
    if not s:
        raise ValueError("empty")
    if s == "?":
        raise Oops("custom")
    return [int(x) for x in s.split(",")]


TABLE = {"a": (1, 2.5, None), "b": {3, 4}}
'''


def _run(tmp_path, hidden):
    write_files(tmp_path, {"lib/__init__.py": "", "lib/core.py": CODE})
    return run_hidden_runner(hidden, tmp_path, local_run, 30)


def test_ids_values_exceptions_and_handles(tmp_path):
    hidden = {"checks/test_core.py":
        "from lib.core import Counter, Oops, parse, TABLE\n"
        "import lib.core as core\n\n\n"
        "def test_values():\n"
        "    assert parse('1,2') == [1, 2] and type(parse('3')) is list\n"
        "    assert TABLE == {'a': (1, 2.5, None), 'b': {3, 4}}\n\n\n"
        "def test_builtin_exception():\n"
        "    try:\n        parse('')\n    except ValueError as e:\n        assert 'empty' in str(e)\n"
        "    else:\n        raise AssertionError('no error')\n\n\n"
        "def test_custom_exception_is_not_builtin():\n"
        "    try:\n        parse('?')\n    except ValueError:\n        raise AssertionError('mapped')\n"
        "    except Exception as e:\n        assert 'Oops' in str(e)\n\n\n"
        "def test_handles():\n"
        "    c = Counter()\n    c.step = 3\n    c.inc().inc()\n    assert c.value == 6\n"
        "    assert c != 6 and str(c).startswith('<lib.core.Counter')\n\n\n"
        "def test_fails():\n    assert core.parse('5') == [6]\n",
        "checks/plain.py": "from lib.core import parse\nassert parse('7') == [7]\ncheck('seven', True)\ncheck('x', 1)\n"}
    assert expected_test_ids(hidden) == [
        "checks/plain.py", "checks/test_core.py::test_values", "checks/test_core.py::test_builtin_exception",
        "checks/test_core.py::test_custom_exception_is_not_builtin", "checks/test_core.py::test_handles",
        "checks/test_core.py::test_fails"]
    d = _run(tmp_path, hidden)
    assert d["tests"] == {i: ("fail" if i.endswith("test_fails") else "pass") for i in expected_test_ids(hidden)}, d
    assert d["checks"] == {"seven": "pass", "x": "fail"}
    assert not d["passed"] and d["score"] == 0.5  # the checks give the partial credit


def test_unimportable_code_fails_every_test_of_the_file(tmp_path):
    write_files(tmp_path, {"m.py": "raise SystemExit(0)\n"})
    hidden = {"t.py": "import m\n\n\ndef test_a():\n    pass\n\n\ndef test_b():\n    pass\n"}
    d = run_hidden_runner(hidden, tmp_path, local_run, 30)
    assert d["tests"] == {"t.py::test_a": "fail", "t.py::test_b": "fail"} and "SystemExit" in str(d["errors"])
