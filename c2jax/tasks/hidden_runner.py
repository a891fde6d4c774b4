"""The hidden-test runner: runs a task's hidden tests against code it never imports.

This file is a standalone script (stdlib only). The grader (c2jax.tasks.grading) starts it
inside the sandbox as `python3 -I -S -c <this source> run`, in the task root, and writes one
JSON object to its stdin: a fresh random HMAC key, a fresh run id, the hidden test sources
(path -> text) and a time budget. The tests never touch the disk.

Threat model: everything the task's code does is hostile. It may print anything, exit early
(`os._exit(0)`, `sys.exit(0)`, atexit hooks, signals), patch any module it can import (unittest,
builtins, assert helpers), delete or rewrite files in the tree, plant sitecustomize.py,
usercustomize.py, .pth files, conftest.py or stdlib-named modules, and read anything in its
own process (argv, environment, memory). So:
  * The runner (this process, "the judge") never imports the task's code. It is started with
    -I -S (no cwd, PYTHONPATH, site or .pth on sys.path), reads its stdin to the end before
    anything else runs, and makes itself non-dumpable (PR_SET_DUMPABLE 0), so processes of
    the same uid cannot ptrace it or open its /proc/<pid>/{mem,fd}.
  * The task's code runs in a worker process (one per hidden test file, stdin /dev/null, its
    output captured), which imports modules from the task root on request and answers calls
    over a socket. The judge executes the hidden test itself; a task module it imports is a
    proxy whose attributes and calls are remote. Values cross as Python literals parsed by a
    restricted decoder (plain builtin types only), anything else as an opaque handle, and an
    exception as its builtin type (or RemoteError). So a test's asserts run in the judge on
    genuine values: the worker can only give wrong answers, die, or stall, which fail. A star
    import from a task module never binds a builtin or a name the test binds itself, so the
    task cannot replace the helpers (`abs`, `_same`, `check`) its own asserts use; helpers a
    test takes from the task module are the task's (HumanEval runs its trusted reference
    module in the judge for that reason).
  * The judge reports once, on stdout, as `C2JAX_RESULT <hmac> <json>`: per hidden test id
    (a file, or `file::test_fn` for files defining test_* functions) "pass" or "fail", named
    checks (`check(name, ok)`, partial credit) and the run id, signed with the key. The key
    exists only in the judge's memory, so a printed or replayed line does not verify; the
    grader also requires the exact expected set of test ids, all passed.
"""
import ast
import builtins
import hashlib
import hmac
import importlib.abc
import importlib.machinery
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types

RESULT_PREFIX = "C2JAX_RESULT "
MAX_MSG = 8 << 20
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_NAMES = {"inf": float("inf"), "nan": float("nan"), "True": True, "False": False, "None": None}


# ----- values across the boundary ----------------------------------------------------------

def decode_literal(text):
    """Parses a repr of plain builtin values (no code runs; anything else raises ValueError)."""
    if not isinstance(text, str) or len(text) > MAX_MSG:
        raise ValueError("value text too long")
    try:
        node = ast.parse(text, mode="eval").body
        return _lit(node)
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a plain value: {type(e).__name__}") from None


def _lit(n):
    if isinstance(n, ast.Constant) and type(n.value) in _PLAIN:
        return n.value
    if isinstance(n, ast.Name) and n.id in _NAMES:
        return _NAMES[n.id]
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
        v = _lit(n.operand)
        if type(v) in (int, float, complex):
            return -v if isinstance(n.op, ast.USub) else v
    if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)):
        a, b = _lit(n.left), _lit(n.right)
        if type(a) in (int, float) and type(b) is complex:
            return a + b if isinstance(n.op, ast.Add) else a - b
    if isinstance(n, ast.Tuple):
        return tuple(_lit(e) for e in n.elts)
    if isinstance(n, ast.List):
        return [_lit(e) for e in n.elts]
    if isinstance(n, ast.Set):
        return {_lit(e) for e in n.elts}
    if isinstance(n, ast.Dict) and None not in n.keys:
        return {_lit(k): _lit(v) for k, v in zip(n.keys, n.values)}
    if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("set", "frozenset")
            and not n.keywords and len(n.args) <= 1):
        items = _lit(n.args[0]) if n.args else ()
        if type(items) not in (list, tuple, set):
            raise ValueError("bad set")
        return set(items) if n.func.id == "set" else frozenset(items)
    raise ValueError(f"not a plain value: {type(n).__name__}")


def is_plain(v, depth=0):
    """Only exact builtin types: a subclass could carry its own __eq__."""
    if depth > 50:
        return False
    t = type(v)
    if t in _PLAIN:
        return True
    if t in (list, tuple, set, frozenset):
        return all(is_plain(x, depth + 1) for x in v)
    if t is dict:
        return all(is_plain(k, depth + 1) and is_plain(x, depth + 1) for k, x in v.items())
    return False


def _send(f, obj):
    f.write(json.dumps(obj).encode() + b"\n")
    f.flush()


def _recv(f):
    line = f.readline(MAX_MSG + 1)
    if not line:
        raise EOFError
    if len(line) > MAX_MSG:
        raise ValueError("message too long")
    return json.loads(line)


# ----- the worker: imports and runs the task's code on request ------------------------------

def worker(fd, root):
    sock = socket.socket(fileno=fd)
    f = sock.makefile("rwb")
    sys.path.insert(0, root)
    handles = {}

    def enc(v):
        if is_plain(v):
            try:
                return {"v": repr(v)}
            except Exception:  # noqa: BLE001 - e.g. a huge int
                pass
        handles[len(handles) + 1] = v
        kind = "module" if isinstance(v, types.ModuleType) else "callable" if callable(v) else "object"
        return {"h": len(handles), "kind": kind}

    def dec(a):
        return handles[a["h"]] if "h" in a else decode_literal(a["v"])

    while True:
        try:
            msg = _recv(f)
        except (EOFError, OSError, ValueError):
            os._exit(0)
        try:
            op = msg["op"]
            if op == "import":
                import importlib
                mod = importlib.import_module(msg["name"])
                names = getattr(mod, "__all__", None)
                if not isinstance(names, (list, tuple)):
                    names = [k for k in vars(mod) if not k.startswith("_")]
                reply = {"ok": enc(mod), "names": [str(n) for n in names],
                         "package": hasattr(mod, "__path__")}
            else:
                obj = handles[msg["h"]]
                if op == "getattr":
                    reply = {"ok": enc(getattr(obj, msg["name"]))}
                elif op == "call":
                    args = [dec(a) for a in msg["args"]]
                    kwargs = {k: dec(a) for k, a in msg["kwargs"].items()}
                    reply = {"ok": enc(obj(*args, **kwargs))}
                elif op == "setattr":
                    setattr(obj, msg["name"], dec(msg["value"]))
                    reply = {"ok": enc(None)}
                elif op == "getitem":
                    reply = {"ok": enc(obj[dec(msg["key"])])}
                elif op == "len":
                    reply = {"ok": enc(len(obj))}
                elif op == "list":
                    reply = {"ok": [enc(x) for x in list(obj)]}
                elif op == "contains":
                    reply = {"ok": enc(dec(msg["item"]) in obj)}
                elif op == "bool":
                    reply = {"ok": enc(bool(obj))}
                elif op == "str":
                    reply = {"ok": enc(str(obj)[:2000])}
                else:
                    reply = {"raise": "RuntimeError", "msg": f"unknown op {op!r}"}
        except BaseException as e:  # noqa: BLE001 - SystemExit at import included: an answer
            try:
                text = str(e)[:500]
            except BaseException:  # noqa: BLE001
                text = ""
            reply = {"raise": type(e).__name__, "msg": text}
        try:
            _send(f, reply)
        except (OSError, TypeError, ValueError):
            os._exit(0)


# ----- the judge: runs the hidden tests, proxies the task's modules -----------------------------

class RemoteError(Exception):
    """The code under test raised a non-builtin exception, died, stalled or sent junk."""


class _Worker:
    def __init__(self, root, deadline):
        a, b = socket.socketpair()
        self.deadline = deadline
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _SOURCE, "worker", str(b.fileno()), root],
            pass_fds=(b.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, cwd=root, close_fds=True)
        b.close()
        self.sock = a
        self.f = a.makefile("rwb")
        self.output = bytearray()
        self.dead = ""
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):
            self.output += chunk
            del self.output[:-4000]

    def rpc(self, msg):
        if self.dead:
            raise RemoteError(self.dead)
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.dead = "time budget spent"
            raise TimeoutError(self.dead)
        self.sock.settimeout(left)
        try:
            _send(self.f, msg)
            reply = _recv(self.f)
        except (EOFError, OSError, ValueError) as e:
            self.dead = f"the code under test stopped answering ({type(e).__name__})"
            self.close()
            raise RemoteError(self.dead) from None
        if not isinstance(reply, dict):
            raise RemoteError("bad reply")
        if "raise" in reply:
            raise _exception(str(reply.get("raise")), str(reply.get("msg", "")))
        return reply

    def value(self, enc):
        if not isinstance(enc, dict):
            raise RemoteError("bad reply")
        if "h" in enc:
            return _Remote(self, int(enc["h"]), str(enc.get("kind", "")))
        return decode_literal(enc.get("v"))

    def close(self):
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()


def _exception(name, msg):
    cls = getattr(builtins, name, None)
    if (isinstance(cls, type) and issubclass(cls, Exception)
            and not issubclass(cls, (StopIteration, StopAsyncIteration))):
        try:
            return cls(msg)
        except Exception:  # noqa: BLE001
            pass
    return RemoteError(f"{name}: {msg}")


def _arg(v):
    if isinstance(v, _Remote):
        return {"h": object.__getattribute__(v, "_h")}
    if not is_plain(v):
        raise TypeError(f"cannot pass a {type(v).__name__} to the code under test (plain values only)")
    return {"v": repr(v)}


class _Remote:
    """A value the code under test holds: every use is a call into the worker."""

    def __init__(self, w, h, kind):
        object.__setattr__(self, "_w", w)
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_kind", kind)

    def _op(self, op, **kw):
        w = object.__getattribute__(self, "_w")
        return w.rpc({"op": op, "h": object.__getattribute__(self, "_h"), **kw})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return object.__getattribute__(self, "_w").value(self._op("getattr", name=name)["ok"])

    def __setattr__(self, name, value):
        self._op("setattr", name=name, value=_arg(value))

    def __call__(self, *args, **kwargs):
        r = self._op("call", args=[_arg(a) for a in args], kwargs={str(k): _arg(v) for k, v in kwargs.items()})
        return object.__getattribute__(self, "_w").value(r["ok"])

    def __getitem__(self, key):
        return object.__getattribute__(self, "_w").value(self._op("getitem", key=_arg(key))["ok"])

    def __len__(self):
        n = object.__getattribute__(self, "_w").value(self._op("len")["ok"])
        if type(n) is not int:
            raise RemoteError("len() is not an int")
        return n

    def __iter__(self):
        w = object.__getattribute__(self, "_w")
        items = self._op("list")["ok"]
        if not isinstance(items, list):
            raise RemoteError("bad reply")
        return iter([w.value(x) for x in items])

    def __contains__(self, item):
        return object.__getattribute__(self, "_w").value(self._op("contains", item=_arg(item))["ok"]) is True

    def __bool__(self):
        return object.__getattribute__(self, "_w").value(self._op("bool")["ok"]) is True

    def __str__(self):
        s = object.__getattribute__(self, "_w").value(self._op("str")["ok"])
        return s if type(s) is str else "<remote>"

    __repr__ = __str__


class _RemoteModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_c2jax_remote"], name)


class _Importer(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Task modules (names under the task root that the judge's stdlib does not have) as proxies."""

    def __init__(self, worker_, root, protected=frozenset()):
        self.w, self.root = worker_, root
        self.protected = protected  # names a star import may not bind (see _bound_names)
        self.loaded = []

    def _ours(self, top):
        if top in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(top) is not None:
            return False
        return os.path.exists(os.path.join(self.root, top + ".py")) or os.path.isdir(os.path.join(self.root, top))

    def find_spec(self, fullname, path=None, target=None):
        if not self._ours(fullname.split(".")[0]):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        r = self.w.rpc({"op": "import", "name": spec.name})
        m = _RemoteModule(spec.name)
        m.__dict__["_c2jax_remote"] = self.w.value(r["ok"])
        names = r.get("names")
        if isinstance(names, list):
            m.__all__ = [n for n in names if type(n) is str and n.isidentifier() and not n.startswith("_")
                         and n not in self.protected]
        self.loaded.append(spec.name)
        return m

    def exec_module(self, module):
        pass


def _bound_names(tree):
    """Builtins and every name the test binds itself: `from task_module import *` may not
    replace them (a task module listing `abs` in __all__ would otherwise judge its own asserts)."""
    names = set(dir(builtins)) | {"check"}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name != "*"}
    return frozenset(names)


def _test_functions(src):
    tree = ast.parse(src)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")]


def _fail(e):
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001
        text = type(e).__name__
    return {"outcome": "fail", "error": text[:300]}


def run_file(path, src, root, deadline, tests, checks):
    """Runs one hidden test file against a fresh worker; records its test ids."""
    try:
        fns = _test_functions(src)
        code = compile(src, path, "exec")
    except SyntaxError as e:
        tests[path] = _fail(e)
        return
    ids = [f"{path}::{n}" for n in fns] or [path]

    def check(name, ok):
        """Records a named check (partial credit); True passes, anything else fails."""
        checks[str(name)] = "pass" if ok is True else "fail"
        return ok is True

    w = _Worker(root, deadline)
    imp = _Importer(w, root, _bound_names(ast.parse(src)))
    sys.meta_path.insert(0, imp)
    ns = {"__name__": "__c2jax_hidden__", "__file__": os.path.join(root, path), "__builtins__": builtins,
          "check": check}
    try:
        try:
            exec(code, ns)  # noqa: S102 - the task's own hidden test, never the model's code
        except BaseException as e:  # noqa: BLE001
            for i in ids:
                tests[i] = _fail(e)
            return
        if not fns:
            tests[path] = {"outcome": "pass"}
        for name, i in zip(fns, ids):
            try:
                ns[name]()
                tests[i] = {"outcome": "pass"}
            except BaseException as e:  # noqa: BLE001
                tests[i] = _fail(e)
    finally:
        sys.meta_path.remove(imp)
        for name in imp.loaded:
            sys.modules.pop(name, None)
        w.close()
        out = bytes(w.output).decode("utf-8", "replace")
        if out:
            sys.stderr.write(f"--- output of the code under test ({path}) ---\n{out}\n")


def _undumpable():
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            raise OSError("prctl failed")
    except (OSError, AttributeError):
        if sys.platform.startswith("linux"):
            raise


def judge():
    _undumpable()
    cfg = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    sys.stdin.close()
    key = bytes.fromhex(cfg.pop("key"))
    root = os.getcwd()
    deadline = time.monotonic() + float(cfg.get("timeout_s", 60.0))
    out = sys.stdout
    sys.stdout = sys.stderr  # the tests' own prints
    tests, checks = {}, {}
    for path, src in cfg["tests"].items():
        run_file(path, src, root, deadline, tests, checks)
        os.chdir(root)
    body = json.dumps({"run": cfg["run"], "complete": True, "tests": tests, "checks": checks}, sort_keys=True)
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    out.write(RESULT_PREFIX + mac + " " + body + "\n")
    out.flush()
    sys.stderr.flush()
    os._exit(0)


def _source():
    with open(__file__) as f:
        return f.read()


# Started with -c, the script has no file: the grader prepends `_SOURCE_TEXT = <its text>`.
_SOURCE = globals().get("_SOURCE_TEXT") or (_source() if "__file__" in globals() else "")

if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["run"]:
        judge()
