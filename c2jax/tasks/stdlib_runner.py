"""The runner that grades a stdlib-bug task with CPython's own unittest file.

CPython's test files pass callbacks, subclasses and file objects into the module under test,
so, unlike the harness runner (c2jax.tasks.hidden_runner), this one must import the task's
module into the process that runs the tests. What keeps a pass signal unforgeable here:

  * Protocol. The grader starts `python3 -I -S -c <RUNNER_SOURCE>` in the task root and writes
    one JSON object to its stdin: a fresh HMAC key, a fresh run id, the test file's text and
    the ids of the tests that must pass. Nothing of it is on disk or in argv. Before the task
    code is imported, fds 1 and 2 point to /dev/null; the runner writes its one signed record
    (`C2JAX_RESULT <hmac> <json>`, per test "pass"/"fail" with the error line) on a private
    duplicate of the original stdout. The grader (grading.verify_result) trusts only that
    record, for that run, naming exactly the expected test ids. An early exit, a printed
    marker, deleted or overwritten test files and planted files all grade as failures.
  * Imports. Only the module under test comes from the task root, through a finder that maps
    that one name to that one file: the root is not on sys.path, so a planted `unittest.py`,
    `sitecustomize.py` or `.pth` file is never imported.
  * Containment at run time. An audit hook (which Python code cannot remove) is installed
    before the task module is imported. For actions whose innermost Python caller is the task
    module it refuses, and records as a violation, anything the original module does not do
    itself: importing a module it does not import, frame and garbage-collector introspection
    (`sys._getframe`, `tb_frame`, `gc.get_objects`), restricted attribute access (`__code__`,
    `__globals__`), compiling or exec'ing code, opening files, starting processes, ctypes,
    sockets, tracing hooks. The identities of unittest's run machinery and of every builtin are
    checked again after the tests; a change is a violation. Any violation fails the grade.
  * Containment before running (c2jax.tasks.containment, on the host): a submission may not
    add imports, dunder attributes or reflective builtins the original does not use.

What this does not cover: code in the same process as the tests can, in principle, reach the
runner through object graphs the two checks do not name. The static check makes the known
routes (module globals, frames, gc, `__subclasses__`) fail before the tests run; the suite's
regression attacks (tests/tasks/test_stdlib_grading.py) pin what is covered.
"""
from __future__ import annotations

RUNNER_SOURCE = r'''
import _hashlib, builtins, contextlib, importlib.abc, importlib.util, io, json, os, re, shutil, sys, tempfile
import types, unittest


def main():
    cfg = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    sys.stdin.close()
    key = bytes.fromhex(cfg.pop("key"))
    run_id = cfg["run"]
    root = os.getcwd()
    mod_name, task_file = cfg["module"], os.path.join(root, cfg["module_file"])
    allowed_imports = set(cfg.get("allowed_imports") or ())
    allowed_attrs = set(cfg.get("allowed_attrs") or ())
    allowed_events = set(cfg.get("allowed_events") or ())
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    except Exception:
        pass

    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.stdout = sys.stderr = io.StringIO()

    # bound now, before any task code runs: what signs and writes the record
    dumps, hmac_digest, write, exit_now = json.dumps, _hashlib.hmac_digest, os.write, os._exit
    rmtree = shutil.rmtree
    try:  # tests may write scratch files into the cwd: a fresh temp dir, removed before exiting
        scratch = tempfile.mkdtemp(prefix="c2jax_tests_")
        os.chdir(scratch)
    except OSError:
        scratch = None

    def emit(tests, violations, shadow_ok):
        body = dumps({"run": run_id, "complete": True, "tests": tests, "checks": {},
                      "violations": violations[:20], "shadow_ok": shadow_ok}, sort_keys=True)
        mac = hmac_digest(key, body.encode(), "sha256").hex()
        data = ("C2JAX_RESULT " + mac + " " + body + "\n").encode()
        if scratch:
            os.chdir(root)
            rmtree(scratch, ignore_errors=True)
        while data:
            data = data[write(result_fd, data):]
        exit_now(0)

    # --- the run-time guard ----------------------------------------------------------------
    violations = []
    busy = [False]
    getframe = sys._getframe
    always = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
              "os.kill", "os.killpg", "subprocess.Popen", "ctypes.", "socket.", "sys.addaudithook",
              "sys.settrace", "sys.setprofile", "sys._current_frames", "gc.get_objects",
              "gc.get_referrers", "gc.get_referents", "sys.monitoring", "cpython.PyInterpreterState",
              "os.remove", "os.rename", "os.rmdir", "os.unlink", "shutil.", "os.chmod", "os.chdir",
              "os.putenv", "os.unsetenv", "os.truncate", "sys._getframe", "sys._getframemodulename",
              "exec", "compile", "open", "os.listdir", "os.scandir", "os.walk", "glob.glob",
              "marshal.", "pickle.find_class", "code.__new__", "function.__new__", "builtins.input",
              "sys.excepthook", "sys.unraisablehook", "signal.")

    def innermost_is_task(skip_import_system=False):
        # the innermost Python frame; for "import", the statement's frame (the import system's
        # own frames skipped); other events raised inside the import system are its own
        f = getframe(2)
        while skip_import_system and f is not None and f.f_code.co_filename.startswith("<frozen"):
            f = f.f_back
        return f is not None and f.f_code.co_filename == task_file

    def hook(event, args):
        if busy[0]:
            return
        busy[0] = True
        try:
            if event == "import":
                if args[0].split(".")[0] not in allowed_imports and innermost_is_task(True):
                    bad = "import " + str(args[0])
                else:
                    return
            elif event.startswith("object.__"):
                if innermost_is_task() and str(args[1]) not in allowed_attrs:
                    bad = event + " " + str(args[1])
                else:
                    return
            elif event.startswith(always) and event not in allowed_events and innermost_is_task():
                bad = event
            else:
                return
            violations.append(bad)
        finally:
            busy[0] = False
        raise PermissionError("c2jax grader: " + bad + " is not allowed in the code under test")

    # identities checked after every test: builtins, unittest's run machinery, the runner's own
    # result class, the test file's classes and functions, what formats the record
    watched_classes = [unittest.TestCase, unittest.TestSuite, unittest.TestResult, unittest.BaseTestSuite,
                       unittest.case._Outcome, json.encoder.JSONEncoder]
    watched_modules = [builtins, json, json.encoder, unittest, unittest.case, unittest.suite, unittest.result]

    def machinery():
        out = {}
        for m in watched_modules:
            for k, v in vars(m).items():
                out[m.__name__ + "." + k] = id(v)
        for cls in watched_classes:
            for k, v in vars(cls).items():
                out[cls.__module__ + "." + cls.__qualname__ + "." + k] = id(v)
        return out

    # --- importing exactly one module from the task root ------------------------------------
    class TaskFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == mod_name:
                return importlib.util.spec_from_file_location(mod_name, task_file)
            return None

    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != root]
    sys.meta_path.insert(0, TaskFinder())
    for name in list(sys.modules):
        if name == mod_name or name.startswith(mod_name + "."):
            del sys.modules[name]

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

        def stopTest(self, test):
            super().stopTest(test)
            check_machinery(test.id())

    def check_machinery(where):
        now = machinery()
        changed = sorted(k for k in before if now.get(k) != before[k])
        if changed:
            violations.extend("changed " + k + " (after " + where + ")" for k in changed[:5])
            before.update(now)

    watched_classes.append(Result)
    before = machinery()
    sys.addaudithook(hook)
    select = cfg.get("select")
    try:
        testmod = types.ModuleType(cfg["test_name"])
        testmod.__file__ = cfg.get("test_path") or os.path.join(root, cfg["test_name"] + ".py")
        sys.modules[testmod.__name__] = testmod
        exec(compile(cfg["test_src"], testmod.__file__, "exec"), testmod.__dict__)
    except BaseException as e:  # the module under test failed to import
        msg = (type(e).__name__ + ": " + str(e))[:300]
        emit({"<import>": {"outcome": "error", "error": msg}}, violations, False)

    def local(path):
        return bool(path) and os.path.abspath(path) == task_file

    checked, shadow_ok = 0, True
    for m in [sys.modules.get(mod_name)] + [v for v in vars(testmod).values() if isinstance(v, types.ModuleType)]:
        if isinstance(m, types.ModuleType) and m.__name__ == mod_name:
            checked += 1
            shadow_ok &= local(getattr(m, "__file__", None))
    for v in vars(testmod).values():
        if getattr(v, "__module__", None) == mod_name and hasattr(v, "__code__"):
            checked += 1
            shadow_ok &= local(v.__code__.co_filename)
    shadow_ok = shadow_ok and checked > 0
    check_machinery("loading the tests")
    for v in list(vars(testmod).values()):  # the test file's own classes, helpers and fixtures
        if isinstance(v, type) and v.__module__ == testmod.__name__:
            watched_classes.append(v)
    watched_modules.append(testmod)
    before.update(machinery())

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

    suite = unittest.defaultTestLoader.loadTestsFromModule(testmod)
    wanted = {t.id() for t in flatten(suite)} if select is None else set(select)
    suite = keep(suite, wanted)
    res = Result()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        suite.run(res)
    check_machinery("the last test")
    tests = {}
    for i in sorted(wanted):
        o = res.outcomes.get(i, "missing")
        tests[i] = {"outcome": "pass" if o in ("pass", "skip") else "fail", "raw": o}
        if i in res.messages:
            tests[i]["error"] = res.messages[i]
    emit(tests, violations, shadow_ok)


main()
'''
