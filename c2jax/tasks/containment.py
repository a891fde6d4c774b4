"""Static containment check of a submitted module against the code it replaces.

For graders that must import the submission into the process that runs the tests (the
stdlib-bug suite runs CPython's own unittest files): before any test runs, the submission may
use no module, dunder attribute, reflective builtin or introspection attribute more often than
the original does. A bug fix needs none of them; every known route from module code to the
test machinery (module globals -> sys.modules, frames, gc, `__subclasses__`, `getattr` with a
built string) does. The run-time half of the guard is the audit hook in
c2jax.tasks.stdlib_runner.
"""
from __future__ import annotations

import ast
from collections import Counter

# Builtins that reach code objects, frames, namespaces or the import system.
REFLECTIVE_NAMES = frozenset({
    "exec", "eval", "compile", "__import__", "getattr", "setattr", "delattr", "globals", "locals",
    "vars", "open", "breakpoint", "input", "help", "memoryview", "__builtins__", "__loader__",
    "__spec__", "__build_class__", "exit", "quit", "copyright", "credits", "license",
})
# Attributes of frames, tracebacks, generators, code and modules that lead out of the module.
INTROSPECTION_ATTRS = frozenset({
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "tb_frame", "tb_next", "gi_frame",
    "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code", "co_consts", "modules",
    "meta_path", "path_hooks", "stdout", "stderr", "stdin", "argv", "environ", "_exit", "system",
    "popen", "fork", "kill", "_getframe", "settrace", "setprofile", "addaudithook",
})


def _uses(source: str) -> Counter:
    tree = ast.parse(source)
    uses: Counter = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses.update("import " + a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            uses["import " + ("." * node.level) + (node.module or "").split(".")[0]] += 1
            uses.update("from-import " + a.name for a in node.names)
        elif isinstance(node, ast.Attribute):
            if (node.attr.startswith("__") and node.attr.endswith("__")) or node.attr in INTROSPECTION_ATTRS:
                uses["attribute ." + node.attr] += 1
        elif isinstance(node, ast.Name) and node.id in REFLECTIVE_NAMES:
            uses["name " + node.id] += 1
        elif isinstance(node, ast.Global | ast.Nonlocal):
            uses.update("global " + n for n in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "__" in node.value:
            uses["dunder string"] += 1
    return uses


def containment_violations(submitted: str, originals: list[str]) -> list[str]:
    """What `submitted` uses more often than every one of `originals` allows (empty: contained).

    Each entry names the construct and the counts, e.g. "import os: 1 > 0". A submission that is
    not valid Python is reported as such (the tests would fail on it anyway).
    """
    try:
        got = _uses(submitted)
    except (SyntaxError, ValueError, RecursionError) as e:
        return [f"not valid Python: {type(e).__name__}"]
    allowed: Counter = Counter()
    for src in originals:
        try:
            allowed |= _uses(src)
        except (SyntaxError, ValueError, RecursionError):
            continue
    return [f"{k}: {n} > {allowed[k]}" for k, n in sorted(got.items()) if n > allowed[k]]


def runtime_allowances(originals: list[str]) -> dict[str, list[str]]:
    """What the run-time guard lets the module do because the original does it too."""
    imports: set[str] = set()
    attrs: set[str] = set()
    names: set[str] = set()
    for src in originals:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imports.add(node.module.split(".")[0])
            elif isinstance(node, ast.Attribute):
                attrs.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
    events: set[str] = set()
    if "open" in names:
        events.add("open")
    if names & {"exec", "eval", "compile"}:
        events |= {"exec", "compile"}
    return {"allowed_imports": sorted(imports), "allowed_attrs": sorted(attrs), "allowed_events": sorted(events)}
