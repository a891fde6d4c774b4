"""Real-code tasks: bugs injected into pure-Python standard-library modules.

Each task's repository is one CPython 3.12 module (`textwrap.py`, ...) with one AST-located
mutation (operator swap, comparison flip, boolean flip, off-by-one constant, removed
statement, swapped arguments, dropped `not`/negation). The grader is CPython's own test file
for that module (`Lib/test/test_textwrap.py`), hidden, run by `stdlib_runner` so that it
imports the task's copy of the module and not the installed one (checked at run time).

A mutant becomes a task only if it breaks at least one test that passes on the original
(fail-to-pass tests, `metadata["fail_to_pass"]`) and the module still imports. Grading asks
every test that passed on the original (fail-to-pass plus pass-to-pass) to pass.

Discovery runs the test file once per candidate mutant; results are cached as JSON under
`$C2JAX_CACHE` (default ~/.cache/c2jax)/stdlib_bugs/py3.12/<module>/<source hash>.json.
Split: by module (heldout modules never appear in train).

Pass signal: the test file must import the task's module into its own process, so these
tasks have their own runner (c2jax.tasks.stdlib_runner: signed per-test record over a private
fd, one-module import finder, audit-hook guard) and a static containment check of the
submission (c2jax.tasks.containment); both modules' docstrings say what they cover.
"""
from __future__ import annotations

import ast
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import random
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from c2jax.tasks.base import HIDDEN_DIR, Grade, Task, local_run, minimal_edit, stable_hash
from c2jax.tasks.containment import containment_violations, runtime_allowances
from c2jax.tasks.grading import run_signed_runner
from c2jax.tasks.stdlib_runner import RUNNER_SOURCE

TRAIN_MODULES = ("textwrap", "fnmatch", "shlex", "heapq", "string", "base64", "graphlib",
                 "fractions", "difflib")
HELDOUT_MODULES = ("colorsys", "bisect", "quopri", "reprlib")
STDLIB_DIR = Path(sysconfig.get_paths()["stdlib"])
TEST_DIR = STDLIB_DIR / "test"
MAX_WORKERS = 2
RUN_TIMEOUT_S = 30.0


def cache_dir() -> Path:
    base = os.environ.get("C2JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "c2jax")
    return Path(base) / "stdlib_bugs" / f"py{sys.version_info[0]}.{sys.version_info[1]}"


def module_sources(module: str) -> tuple[str, str]:
    """(module source, test file source) from this interpreter's standard library."""
    src, test = STDLIB_DIR / f"{module}.py", TEST_DIR / f"test_{module}.py"
    if not src.exists() or not test.exists():
        raise FileNotFoundError(f"stdlib_bugs needs {src} and {test} (CPython's Lib/test); "
                                "install a Python 3.12 that ships its test package")
    return src.read_text(), test.read_text()


# ---------------------------------------------------------------- mutations

@dataclasses.dataclass(frozen=True)
class Mutation:
    mutation_id: str
    kind: str
    lineno: int
    source: str  # the whole mutated module


_BINOP_SWAP = {ast.Add: (ast.Sub, "+", "-"), ast.Sub: (ast.Add, "-", "+"),
               ast.Mult: (ast.FloorDiv, "*", "//"), ast.FloorDiv: (ast.Mult, "//", "*"),
               ast.Div: (ast.Mult, "/", "*"), ast.Mod: (ast.FloorDiv, "%", "//"),
               ast.BitAnd: (ast.BitOr, "&", "|"), ast.BitOr: (ast.BitAnd, "|", "&"),
               ast.LShift: (ast.RShift, "<<", ">>"), ast.RShift: (ast.LShift, ">>", "<<"),
               ast.Pow: (ast.Mult, "**", "*")}
_AUG = {ast.Add: ("+=", "-="), ast.Sub: ("-=", "+="), ast.Mult: ("*=", "//="),
        ast.BitOr: ("|=", "&="), ast.BitAnd: ("&=", "|=")}
_CMP = {ast.Lt: [("<", "<="), ("<", ">")], ast.LtE: [("<=", "<")], ast.Gt: [(">", ">="), (">", "<")],
        ast.GtE: [(">=", ">")], ast.Eq: [("==", "!=")], ast.NotEq: [("!=", "==")],
        ast.In: [("in", "not in")], ast.NotIn: [("not in", "in")], ast.Is: [("is", "is not")],
        ast.IsNot: [("is not", "is")]}


class _Src:
    def __init__(self, text: str):
        self.text = text
        self.line_starts = [0]
        for line in text.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.lines = text.splitlines(keepends=True)

    def off(self, lineno: int, col_bytes: int) -> int:
        line = self.lines[lineno - 1]
        return self.line_starts[lineno - 1] + len(line.encode()[:col_bytes].decode(errors="replace"))

    def start(self, node) -> int:
        return self.off(node.lineno, node.col_offset)

    def end(self, node) -> int:
        return self.off(node.end_lineno, node.end_col_offset)

    def replace(self, a: int, b: int, new: str) -> str:
        return self.text[:a] + new + self.text[b:]


def _gap_swap(src: _Src, left, right, old: str, new: str) -> str | None:
    a, b = src.end(left), src.start(right)
    gap = src.text[a:b]
    import re
    pat = re.compile(r"(?<![\w<>=!*/|&%+-])" + re.escape(old) + r"(?![\w<>=*/|&%+-])")
    if "#" in gap or len(pat.findall(gap)) != 1:
        return None
    return src.replace(a, b, pat.sub(new, gap, count=1))


def _docstring_nodes(tree) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                ids.add(id(body[0]))
    return ids


def _function_nodes(tree):
    """(node, enclosing function) for nodes inside function bodies, skipping main/_test."""
    out = []

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name in ("main", "_test", "_main") or child.name.startswith("test"):
                    continue
                visit(child, child)
            else:
                if fn is not None:
                    out.append((child, fn))
                visit(child, fn)

    visit(tree, None)
    return out


def enumerate_mutations(text: str) -> list[Mutation]:
    """Every single-site mutation of `text` that compiles and changes the code."""
    tree = ast.parse(text)
    src = _Src(text)
    docstrings = _docstring_nodes(tree)
    bodies = {}
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(parent, field, None)
            if isinstance(body, list):
                for stmt in body:
                    bodies[id(stmt)] = body
    muts: dict[str, Mutation] = {}

    def add(kind, node, new_text, variant=""):
        if new_text is None or new_text == text:
            return  # (whether it compiles is checked when it is evaluated)
        mid = f"{kind}@{node.lineno}:{node.col_offset}{(':' + variant) if variant else ''}"
        muts.setdefault(mid, Mutation(mid, kind, node.lineno, new_text))

    for node, _fn in _function_nodes(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
            _, old, new = _BINOP_SWAP[type(node.op)]
            add("operator_swap", node, _gap_swap(src, node.left, node.right, old, new))
        elif isinstance(node, ast.AugAssign) and type(node.op) in _AUG:
            old, new = _AUG[type(node.op)]
            add("operator_swap", node, _gap_swap(src, node.target, node.value, old, new))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:
            for old, new in _CMP[type(node.ops[0])]:
                add("comparison_flip", node, _gap_swap(src, node.left, node.comparators[0], old, new), new)
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            add("boolean_flip", node, _gap_swap(src, node.values[0], node.values[1], old, new))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            if isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
                v = node.operand.value
                if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 64:
                    for nv, tag in ((-v + 1, "inc"), (-v - 1, "dec")):
                        add("off_by_one", node, src.replace(src.start(node), src.end(node), str(nv)), tag)
                continue
            add("dropped_negation", node,
                src.replace(src.start(node), src.end(node), src.text[src.start(node.operand):src.end(node.operand)]))
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            v = node.value
            seg = src.text[src.start(node):src.end(node)]
            if isinstance(v, bool):
                add("changed_constant", node, src.replace(src.start(node), src.end(node), str(not v)))
            elif isinstance(v, int) and seg == str(v) and 0 <= v <= 64:
                add("off_by_one", node, src.replace(src.start(node), src.end(node), str(v + 1)), "inc")
                if v > 0:
                    add("off_by_one", node, src.replace(src.start(node), src.end(node), str(v - 1)), "dec")
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and not node.keywords \
                and not any(isinstance(a, ast.Starred) for a in node.args[:2]):
            a0, a1 = node.args[0], node.args[1]
            t0 = src.text[src.start(a0):src.end(a0)]
            t1 = src.text[src.start(a1):src.end(a1)]
            if t0 != t1 and "\n" not in t0 + t1:
                new = src.text[:src.start(a0)] + t1 + src.text[src.end(a0):src.start(a1)] + t0 + src.text[src.end(a1):]
                add("swapped_arguments", node, new)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Expr)) and id(node) not in docstrings \
                and node.lineno == node.end_lineno:
            if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call):
                continue
            line = src.lines[node.lineno - 1]
            if line.strip() != src.text[src.start(node):src.end(node)].strip():
                continue  # shares its line with other code
            parent_body = bodies.get(id(node))
            indent = line[: len(line) - len(line.lstrip())]
            repl = f"{indent}pass\n" if parent_body is not None and len(parent_body) == 1 else ""
            a = src.line_starts[node.lineno - 1]
            add("removed_line", node, src.replace(a, a + len(line), repl))
    return [muts[k] for k in sorted(muts)]


# ---------------------------------------------------------------- running the test file

def run_payload(module: str, test_src: str, select, allow_from: list[str]) -> dict:
    """The runner's stdin (without key and run id): what to test and what the module may do."""
    return {"module": module, "module_file": f"{module}.py", "test_name": f"test_{module}",
            "test_src": test_src, "test_path": str(TEST_DIR / f"test_{module}.py"),
            "select": None if select is None else sorted(select), **runtime_allowances(allow_from)}


def run_stdlib_runner(payload: dict, workspace_path: Path, run, timeout_s: float,
                      expected: list[str] | None) -> dict:
    """Runs the stdlib runner in `workspace_path` (grading.run_signed_runner's dict, with per-test
    raw outcomes, error lines, guard violations and shadow_ok). expected None: discovery."""
    return run_signed_runner(["python3", "-I", "-S", "-c", RUNNER_SOURCE], payload, workspace_path, run,
                             timeout_s, expected)


def run_test_file(module: str, module_src: str, test_src: str, select=None, run=local_run,
                  timeout_s: float = RUN_TIMEOUT_S):
    """Run the module's test file against `module_src` in a temp dir.

    Returns (outcomes {test_id: "pass" | "fail" | "error" | "skip" | "missing"} or None,
    messages {test_id: str}, timed_out).
    """
    with tempfile.TemporaryDirectory(prefix="c2jax_stdlib_") as d:
        (Path(d) / f"{module}.py").write_text(module_src)
        res = run_stdlib_runner(run_payload(module, test_src, select, [module_src]), Path(d), run,
                                timeout_s, None)
    if not res["raw"]:
        return None, {}, res["timed_out"]
    if res["violations"]:
        raise RuntimeError(f"stdlib_bugs: {module}'s own code tripped the grader's guard: {res['violations'][:3]}")
    if "<import>" not in res["raw"] and not res["shadow_ok"]:
        raise RuntimeError(f"stdlib_bugs: the test file for {module} did not import the local copy")
    return res["raw"], res["errors"], res["timed_out"]


@dataclasses.dataclass
class StdlibBugTask(Task):
    """A stdlib-bug task: graded by c2jax.tasks.stdlib_runner with CPython's own test file.

    Grading first checks the submitted module against the original and the given (buggy) copy
    (c2jax.tasks.containment), then runs the tests ids in `expected_tests`, all of which must pass.
    """

    expected_tests: tuple = ()
    original_source: str = ""
    uses_harness_runner = False  # a class attribute: the tests run in-process (not a field)

    def __post_init__(self):
        self.expected_tests = tuple(self.expected_tests)
        super().__post_init__()

    def run_hidden_tests(self, workspace_path: Path, run) -> Grade:
        from c2jax.filetree import read_tree
        module = self.metadata["module"]
        fname = f"{module}.py"
        submitted = read_tree(Path(workspace_path)).get(fname)
        originals = [self.original_source, self.files[fname]]
        if submitted is None:
            return Grade(False, 0.0, {"problem": f"{fname} is missing or not a regular file"})
        found = containment_violations(submitted, originals)
        if found:
            return Grade(False, 0.0, {"problem": "the submission uses what a bug fix does not need: "
                                                 + "; ".join(found[:10]), "containment": found})
        test_src = self.hidden_tests[f"{HIDDEN_DIR}/test_{module}.py"]
        payload = run_payload(module, test_src, self.expected_tests, originals)
        d = run_stdlib_runner(payload, Path(workspace_path), run, self.timeout_s, list(self.expected_tests))
        d.pop("raw", None)
        if d["passed"] and not d["shadow_ok"]:
            d.update(passed=False, score=0.0, problem=f"the tests did not run against the task's {fname}")
        return Grade(bool(d.pop("passed")), float(d.pop("score")), d)


class _Cache:
    _lock = threading.Lock()

    def __init__(self, module: str, module_src: str, test_src: str):
        # keyed by everything that decides the outcomes: module, test file, runner script
        key = hashlib.sha256((module_src + "\0" + test_src + "\0" + RUNNER_SOURCE).encode()).hexdigest()[:16]
        self.path = cache_dir() / module / f"{key}.json"
        self.data = {"baseline": None, "mutants": {}}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
            except ValueError:
                pass

    def save(self):
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)


@dataclasses.dataclass
class _Found:
    mutation: Mutation
    fail_to_pass: list[str]
    messages: dict[str, str]


class ModuleMiner:
    """Finds, in a fixed seeded order, the mutants of one module that break its tests."""

    def __init__(self, module: str, seed: int):
        self.module = module
        self.src, self.test_src = module_sources(module)
        self.cache = _Cache(module, self.src, self.test_src)
        if self.cache.data["baseline"] is None:
            t0 = time.monotonic()
            outcomes, _, _ = run_test_file(module, self.src, self.test_src)
            self.cache.data["baseline_s"] = time.monotonic() - t0
            if not outcomes or "<import>" in outcomes:
                raise RuntimeError(f"stdlib_bugs: {module}'s tests do not run on the original")
            self.cache.data["baseline"] = outcomes
            self.cache.save()
        self.baseline = {k for k, v in self.cache.data["baseline"].items() if v == "pass"}
        self.candidates = enumerate_mutations(self.src)
        random.Random(stable_hash("stdlib", module, seed)).shuffle(self.candidates)
        self.pos = 0
        self.found: list[_Found] = []
        self.seen_sources: set[str] = set()

    def _evaluate(self, m: Mutation) -> dict:
        rec = self.cache.data["mutants"].get(m.mutation_id)
        if rec is not None:
            return rec
        try:
            compile(m.source, "<mutant>", "exec")
        except SyntaxError:
            return {"usable": False, "reason": "syntax error"}
        # A mutant that loops forever costs its whole timeout: cap it near the baseline time.
        timeout = min(RUN_TIMEOUT_S, max(3.0, 6 * self.cache.data.get("baseline_s", 1.0)))
        outcomes, messages, timed_out = run_test_file(self.module, m.source, self.test_src,
                                                      timeout_s=timeout)
        if outcomes is None or "<import>" in (outcomes or {}):
            rec = {"usable": False, "reason": "timeout" if timed_out else "no report/import error"}
        else:
            f2p = sorted(t for t in self.baseline if outcomes.get(t) != "pass")
            still = [t for t in self.baseline if outcomes.get(t) == "pass"]
            usable = bool(f2p) and bool(still)
            rec = {"usable": usable, "f2p": f2p,
                   "messages": {t: messages.get(t, "") for t in f2p[:5]}}
        return rec

    def next_found(self, k: int) -> list[_Found]:
        """Grow self.found to at least k (or until candidates run out)."""
        with cf.ThreadPoolExecutor(MAX_WORKERS) as ex:
            while len(self.found) < k and self.pos < len(self.candidates):
                batch = self.candidates[self.pos: self.pos + MAX_WORKERS * 2]
                self.pos += len(batch)
                recs = list(ex.map(self._evaluate, batch))
                for m, rec in zip(batch, recs):
                    self.cache.data["mutants"][m.mutation_id] = rec
                    if rec["usable"] and m.source not in self.seen_sources:
                        self.seen_sources.add(m.source)
                        self.found.append(_Found(m, rec["f2p"], rec["messages"]))
                self.cache.save()
        return self.found[:k]


def _short_id(test_id: str) -> str:
    parts = test_id.split(".")
    return ".".join(parts[-2:]) if len(parts) >= 2 else test_id


def make_task(module: str, split: str, found: _Found, miner: ModuleMiner) -> Task:
    m = found.mutation
    first = found.fail_to_pass[0]
    msg = (found.messages.get(first) or "it fails").strip()
    if len(msg) > 160:
        msg = msg[:157] + "..."
    n = len(found.fail_to_pass)
    more = f" ({n} tests fail in total)" if n > 1 else ""
    prompt = (f"Since the last change to {module}.py, `{_short_id(first)}` fails: {msg}{more}. "
              f"Find and fix the bug; keep the public API unchanged.")
    select = sorted(miner.baseline)
    fname = f"{module}.py"
    return StdlibBugTask(
        task_id=f"stdlib-{module}-{hashlib.sha1((module + m.mutation_id).encode()).hexdigest()[:10]}",
        suite="stdlib_bugs", split=split, prompt=prompt,
        files={fname: m.source},
        hidden_tests={f"{HIDDEN_DIR}/test_{module}.py": miner.test_src},
        test_command=None, expected_tests=select, original_source=miner.src,
        reference_solution=[minimal_edit(fname, m.source, miner.src)],
        metadata={"difficulty": 2, "module": module, "mutation": m.kind, "mutation_id": m.mutation_id,
                  "fail_to_pass": found.fail_to_pass, "n_pass_to_pass": len(select) - n,
                  "python": f"{sys.version_info[0]}.{sys.version_info[1]}"},
        timeout_s=60.0,
    )


def load(split: str, n: int | None = None, seed: int = 0, modules=None) -> list[Task]:
    """n tasks (default 20) round-robin over the split's modules, in a seeded order."""
    n = 20 if n is None else n
    if modules is None:
        modules = TRAIN_MODULES if split == "train" else HELDOUT_MODULES
    modules = list(modules)
    random.Random(stable_hash("stdlib-modules", seed)).shuffle(modules)
    miners = {mod: ModuleMiner(mod, seed) for mod in modules}
    out: list[Task] = []
    exhausted: set[str] = set()
    r = 0
    while len(out) < n and len(exhausted) < len(modules):
        for mod in modules:
            if len(out) >= n or mod in exhausted:
                continue
            found = miners[mod].next_found(r + 1)
            if len(found) <= r:
                exhausted.add(mod)
                continue
            out.append(make_task(mod, split, found[r], miners[mod]))
        r += 1
    return out
