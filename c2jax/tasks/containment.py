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
import functools
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


@functools.lru_cache(maxsize=64)
def _profile(source: str) -> tuple[Counter, frozenset, frozenset, frozenset]:
    """One pass over `source`'s AST (cached: the originals are read at every grading):
    (counted uses, top-level modules imported, attribute names, names)."""
    uses: Counter = Counter()
    imports, attrs, names = set(), set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            tops = [a.name.split(".")[0] for a in node.names]
            uses.update("import " + t for t in tops)
            imports.update(tops)
        elif isinstance(node, ast.ImportFrom):
            uses["import " + ("." * node.level) + (node.module or "").split(".")[0]] += 1
            uses.update("from-import " + a.name for a in node.names)
            if node.level == 0 and node.module:
                imports.add(node.module.split(".")[0])
        elif isinstance(node, ast.Attribute):
            attrs.add(node.attr)
            if (node.attr.startswith("__") and node.attr.endswith("__")) or node.attr in INTROSPECTION_ATTRS:
                uses["attribute ." + node.attr] += 1
        elif isinstance(node, ast.Name):
            names.add(node.id)
            if node.id in REFLECTIVE_NAMES:
                uses["name " + node.id] += 1
        elif isinstance(node, ast.Global | ast.Nonlocal):
            uses.update("global " + n for n in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "__" in node.value:
            uses["dunder string"] += 1
    return uses, frozenset(imports), frozenset(attrs), frozenset(names)


def _profiles(sources: list[str]) -> list[tuple]:
    out = []
    for src in sources:
        try:
            out.append(_profile(src))
        except (SyntaxError, ValueError, RecursionError):
            continue
    return out


def containment_violations(submitted: str, originals: list[str]) -> list[str]:
    """What `submitted` uses more often than every one of `originals` allows (empty: contained).

    Each entry names the construct and the counts, e.g. "import os: 1 > 0". A submission that is
    not valid Python is reported as such (the tests would fail on it anyway).
    """
    try:
        got = _profile(submitted)[0]
    except (SyntaxError, ValueError, RecursionError) as e:
        return [f"not valid Python: {type(e).__name__}"]
    allowed: Counter = Counter()
    for p in _profiles(originals):
        allowed |= p[0]
    return [f"{k}: {n} > {allowed[k]}" for k, n in sorted(got.items()) if n > allowed[k]]


def runtime_allowances(originals: list[str]) -> dict[str, list[str]]:
    """What the run-time guard lets the module do because the original does it too."""
    profiles = _profiles(originals)
    imports = set().union(*(p[1] for p in profiles))
    attrs = set().union(*(p[2] for p in profiles))
    names = set().union(*(p[3] for p in profiles))
    events: set[str] = set()
    if "open" in names:
        events.add("open")
    if names & {"exec", "eval", "compile"}:
        events |= {"exec", "compile"}
    return {"allowed_imports": sorted(imports), "allowed_attrs": sorted(attrs), "allowed_events": sorted(events)}
