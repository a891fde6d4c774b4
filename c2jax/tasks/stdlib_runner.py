"""Source of the hidden runner that grades a stdlib-bug task with CPython's own test file.

`runner_source(module, test_file, select)` returns a standalone script, written at grading
time to `.c2jax_hidden/run_tests.py` next to the test file. It
  1. puts the task root first on sys.path and drops any already-imported copy of the module
     from sys.modules, so the test file imports the task's copy (unittest itself imports
     e.g. difflib/fnmatch/string at startup, so shadowing by path alone is not enough);
  2. loads the test file and checks the shadowing: every module object named after the
     module, and every function the test file took from it, must come from the task root;
  3. runs the selected tests (all when `select` is None) through one TestSuite (class and
     module fixtures still run) and records pass/fail/error/skip per test id;
  4. prints, iff the shadowing held and every selected test passed or skipped,
     `C2JAX_ALL_PASSED <nonce>` (exit 0 in that case only), then
     `C2JAX_REPORT <nonce> {id: outcome}` (the verdict comes first: capped stdout keeps the head).
With `--messages` it also prints `C2JAX_MESSAGES <nonce> {id: last traceback line}`.
"""
from __future__ import annotations

import json

_TEMPLATE = r'''
import importlib.util, json, os, re, sys, types, unittest
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
except Exception:
    pass
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MOD = __MOD__
TEST_FILE = __TEST_FILE__
SELECT = __SELECT__
NONCE = "__C2JAX_NONCE__"
sys.path[:] = [p for p in sys.path if p not in ("", HERE, os.getcwd())]
sys.path.insert(0, ROOT)
SCRATCH = None
try:  # tests may write scratch files into the cwd: a dir inside the hidden dir, removed with it
    os.makedirs(os.path.join(HERE, "scratch"), exist_ok=True)
    os.chdir(os.path.join(HERE, "scratch"))
except OSError:  # hidden dir not writable: a temp dir, removed at exit
    import tempfile
    SCRATCH = tempfile.mkdtemp(prefix="c2jax_tests_")
    os.chdir(SCRATCH)
for name in list(sys.modules):
    if name == MOD or name.startswith(MOD + "."):
        del sys.modules[name]
out = sys.__stdout__


def report(outcomes, shadow_ok, messages=None):
    # the verdict first: a sandbox that caps stdout keeps the head
    ok = shadow_ok and all(v in ("pass", "skip") for v in outcomes.values())
    if ok:
        print("C2JAX_ALL_PASSED " + NONCE, file=out)
    print("C2JAX_REPORT " + NONCE + " " + json.dumps(outcomes, sort_keys=True), file=out)
    if messages is not None:
        print("C2JAX_MESSAGES " + NONCE + " " + json.dumps(messages, sort_keys=True), file=out)
    out.flush()
    if SCRATCH:
        import shutil
        os.chdir(HERE)
        shutil.rmtree(SCRATCH, ignore_errors=True)
    os._exit(0 if ok else 1)


want_messages = "--messages" in sys.argv
try:
    spec = importlib.util.spec_from_file_location(TEST_FILE[:-3], os.path.join(HERE, TEST_FILE))
    testmod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = testmod
    spec.loader.exec_module(testmod)
except BaseException as e:  # the module under test failed to import
    msg = (type(e).__name__ + ": " + str(e))[:300]
    print("C2JAX_IMPORT_ERROR " + msg, file=out)
    report({"<import>": "error"}, False, {"<import>": msg} if want_messages else None)


def _local(path):
    return bool(path) and os.path.abspath(path).startswith(ROOT + os.sep) and not \
        os.path.abspath(path).startswith(HERE + os.sep)


checked, shadow_ok = 0, True
cands = [sys.modules.get(MOD)] + [v for v in vars(testmod).values() if isinstance(v, types.ModuleType)]
for m in cands:
    if isinstance(m, types.ModuleType) and m.__name__ == MOD:
        checked += 1
        shadow_ok &= _local(getattr(m, "__file__", None))
for v in vars(testmod).values():
    if getattr(v, "__module__", None) == MOD and hasattr(v, "__code__"):
        checked += 1
        shadow_ok &= _local(v.__code__.co_filename)
shadow_ok = shadow_ok and checked > 0
print("C2JAX_SHADOW " + ("ok" if shadow_ok else "FAILED") + " checked=" + str(checked), file=out)


def flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flatten(t)
        else:
            yield t


def keep(suite, wanted):
    new = unittest.TestSuite()
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            sub = keep(t, wanted)
            if sub.countTestCases():
                new.addTest(sub)
        elif t.id() in wanted:
            new.addTest(t)
    return new


class Result(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcomes, self.messages = {}, {}

    def _bad(self, test, err, kind):
        self.outcomes[test.id()] = kind
        text = self._exc_info_to_string(err, test).strip().splitlines()
        pick = [ln for ln in text if re.match(r"^[\w.]*(Error|Exception|Exit)\b", ln)]
        line = pick[-1] if pick else (text[-1] if text else kind)
        self.messages.setdefault(test.id(), line.strip()[:300])

    def addSuccess(self, test):
        self.outcomes.setdefault(test.id(), "pass")

    def addFailure(self, test, err):
        self._bad(test, err, "fail")

    def addError(self, test, err):
        self._bad(test, err, "error")

    def addSkip(self, test, reason):
        self.outcomes.setdefault(test.id(), "skip")

    def addExpectedFailure(self, test, err):
        self.outcomes.setdefault(test.id(), "pass")

    def addUnexpectedSuccess(self, test):
        self.outcomes[test.id()] = "fail"

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._bad(test, err, "fail" if issubclass(err[0], test.failureException) else "error")


suite = unittest.defaultTestLoader.loadTestsFromModule(testmod)
ids = [t.id() for t in flatten(suite)]
wanted = set(ids) if SELECT is None else set(SELECT)
suite = keep(suite, wanted)
res = Result()
import io, contextlib
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    suite.run(res)
outcomes = {i: res.outcomes.get(i, "missing") for i in sorted(wanted)}
report(outcomes, shadow_ok, res.messages if want_messages else None)
'''


def runner_source(module: str, test_file: str, select: list[str] | None) -> str:
    return (_TEMPLATE.replace("__MOD__", repr(module)).replace("__TEST_FILE__", repr(test_file))
            .replace("__SELECT__", "None" if select is None else json.dumps(sorted(select))))
