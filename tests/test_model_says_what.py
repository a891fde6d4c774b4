"""The model says what it computes; c2jax.ops decides how. A static read (ast; nothing imported) of
c2jax/models/*.py: no import of the layers that decide how (c2jax.parallel, c2jax.backends,
pallas_kernels) or of the sampler, no call that asks for the platform, the mesh or a stored
weight layout, and no branch whose condition names one of them (mesh, platform, backend,
devices, weight layout, prepared weights, context or expert parallelism). Branches on the model
config (attention kind, QK-norm, tied head) and on the call (a KV cache or none) are what the
model computes and stay."""
from __future__ import annotations

import ast
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "c2jax", "models")

FORBIDDEN_IMPORTS = ("c2jax.parallel", "c2jax.backends", "pallas_kernels", "c2jax.sampling")
# calls that ask how or where the program runs, or what layout a weight was stored in
FORBIDDEN_CALLS = {"default_backend", "devices", "device_count", "local_devices", "get_abstract_mesh",
                   "has_variable", "get_variable", "is_initializing", "current_target"}
# words (parts of a snake_case name, an attribute or a string) a branch condition must not name
FORBIDDEN_WORDS = {"mesh", "platform", "backend", "device", "devices", "layout", "prepared", "packed", "split",
                   "sharded", "quantized", "initializing", "cp", "context", "ep", "expert_parallel", "target",
                   "tpu", "gpu", "cpu", "values_GKN", "values_KN", "ndim"}

# (file, line) pairs that may still break a rule, each with the reason it cannot move yet: none.
EXCEPTIONS: dict[tuple[str, int], str] = {}


def _files():
    return sorted(f for f in os.listdir(MODELS) if f.endswith(".py"))


def _tree(name):
    with open(os.path.join(MODELS, name)) as f:
        return ast.parse(f.read(), name)


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _words(expr) -> set[str]:
    """The snake_case parts (and whole names) of every name, attribute and string in expr."""
    out = set()
    for n in ast.walk(expr):
        text = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else \
            n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
        if text:
            out.add(text)
            out.update(p for p in re.split(r"[_\W]+", text) if p)
    return out


def _conditions(tree):
    """(line, condition) of every branch: if / elif, conditional expressions, while, comprehension filters."""
    for n in ast.walk(tree):
        if isinstance(n, (ast.If, ast.IfExp, ast.While)):
            yield n.lineno, n.test
        elif isinstance(n, ast.comprehension):
            for cond in n.ifs:
                yield cond.lineno, cond


def _called(n) -> str | None:
    if isinstance(n, ast.Call):
        f = n.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return None


def _tainted(tree) -> set[str]:
    """Names assigned from a call whose name says it looks up a forbidden thing (w =
    prepared_weight(...)): branching on them is branching on that thing."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and any(
                _words(ast.Name(c)) & FORBIDDEN_WORDS for c in map(_called, ast.walk(n.value)) if c):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return out


def violations(name: str) -> list[str]:
    """Every place in c2jax/models/<name> that decides how rather than what."""
    out = []
    tree = _tree(name)
    for n in ast.walk(tree):
        bad = [m for m in _imported(n) if any(m == p or m.startswith(p + ".") for p in FORBIDDEN_IMPORTS)]
        if bad:
            out.append((n.lineno, f"imports {bad[0]}"))
        if _called(n) in FORBIDDEN_CALLS:
            out.append((n.lineno, f"calls {_called(n)}()"))
    tainted = _tainted(tree)
    for line, cond in _conditions(tree):
        names = {n.id for n in ast.walk(cond) if isinstance(n, ast.Name)}
        named = sorted((_words(cond) & FORBIDDEN_WORDS) | (names & tainted))
        if named:
            out.append((line, f"branches on {', '.join(named)}: {ast.unparse(cond)}"))
    return [f"c2jax/models/{name}:{line}: {what}" for line, what in sorted(out) if (name, line) not in EXCEPTIONS]


@pytest.mark.parametrize("name", _files())
def test_model_file_says_what_not_how(name):
    assert not violations(name), "\n".join(violations(name))


def test_the_checks_catch_how(tmp_path, monkeypatch):
    """A model file that imports the mesh layer, asks for the backend or branches on a prepared
    weight is caught."""
    src = ("import jax\nfrom c2jax.parallel.context import cp_active\n"
           "def f(m, x, prepared=None):\n"
           "    if jax.default_backend() == 'cpu':\n        return x\n"
           "    y = x if prepared is None else prepared\n"
           "    w = prepared_weight(m, 'kernel')\n    if w is not None:\n        return w\n"
           "    return [a for a in y if a.ndim == 2]\n")
    (tmp_path / "bad.py").write_text(src)
    monkeypatch.setattr(sys.modules[__name__], "MODELS", str(tmp_path))
    found = violations("bad.py")
    assert any("imports c2jax.parallel.context" in v for v in found)
    assert any("calls default_backend()" in v for v in found)
    assert any("branches on backend" in v for v in found)
    assert any("branches on prepared" in v for v in found)
    assert any("branches on ndim" in v for v in found)
    assert any("branches on w:" in v for v in found)
