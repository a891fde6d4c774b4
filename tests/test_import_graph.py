"""The import graph of c2jax and pallas_kernels: no cycles among modules or packages, and the
layers of docs/ARCHITECTURE.md hold (its two tables are parsed here: the layer list, lowest first,
and the lower layers a node must still not import).

A static walk (ast; nothing is imported) of every module under c2jax/ and pallas_kernels/. Every
import of one of their modules counts, at module level or inside a function (a lazy import still
ties the two modules together), except those under `if TYPE_CHECKING:`. `from a.b import c`
resolves to module a.b.c when c is a submodule, else to a.b; importing a package is importing its
__init__. Importing a submodule also runs its parent packages' __init__ files, but those implicit
edges are not counted: a package __init__ that re-exports its submodules forms a cycle with them
only where a submodule names the package itself (`from c2jax.models import forward`).

The package graph has one node per first-level subpackage of c2jax (c2jax.ops), top-level module
(c2jax.config), the root package (c2jax) and pallas_kernels; an edge a -> b for every module
import from inside a to inside b, shown with the file:line of the import.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections import deque
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("c2jax", "pallas_kernels")
ARCHITECTURE = os.path.join("docs", "ARCHITECTURE.md")


@dataclass(frozen=True)
class Edge:
    """One import: `src` imports `dst` at `path:line`."""
    src: str
    dst: str
    path: str
    line: int


def _module_name(relpath: str) -> str:
    parts = relpath[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def discover_modules(root: str = ROOT) -> dict[str, str]:
    """Module name -> path (relative to root) of every .py file under the checked packages."""
    modules = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), root)
                    modules[_module_name(rel)] = rel
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_nodes(tree: ast.AST):
    """Every node that can run: all of the tree except the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _nearest_module(name: str, modules) -> str | None:
    """`name` if it is a module, else its longest prefix that is (e.g. a.b.func -> a.b)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def module_imports(name: str, relpath: str, modules, root: str = ROOT) -> list[Edge]:
    """The c2jax / pallas_kernels modules that module `name` imports (see the module note)."""
    with open(os.path.join(root, relpath)) as f:
        tree = ast.parse(f.read(), relpath)
    is_pkg = relpath.endswith("__init__.py")
    targets: list[tuple[str, int]] = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module
            if not _ours(parent):
                continue
            for alias in node.names:
                sub = f"{parent}.{alias.name}"
                targets.append((sub if sub in modules else parent, node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            targets.append((node.args[0].value, node.lineno))
    edges = []
    for target, line in targets:
        if not _ours(target):
            continue
        dst = _nearest_module(target, modules)
        if dst is not None and dst != name:
            edges.append(Edge(name, dst, relpath, line))
    return edges


def import_graph(root: str = ROOT) -> list[Edge]:
    """Every import edge among the checked packages' modules."""
    modules = discover_modules(root)
    return [e for name, rel in modules.items() for e in module_imports(name, rel, modules, root)]


def _sccs(nodes, succ) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative) with more than one module."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _shortest_path(src, dst, succ, allowed) -> list[str] | None:
    prev, queue = {src: None}, deque([src])
    while queue:
        v = queue.popleft()
        if v == dst:
            path = []
            while v is not None:
                path.append(v)
                v = prev[v]
            return path[::-1]
        for w in sorted(succ.get(v, ())):
            if w in allowed and w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """Import cycles as chains of edges: for every edge inside a strongly connected component, the
    shortest cycle through it (deduplicated), so every import that takes part in a cycle shows."""
    succ: dict[str, set[str]] = {}
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        succ.setdefault(e.src, set()).add(e.dst)
        first.setdefault((e.src, e.dst), e)
    cycles, seen = [], set()
    for comp in _sccs(sorted(succ), succ):
        members = set(comp)
        for v in comp:
            for w in sorted(succ[v] & members):
                back = _shortest_path(w, v, succ, members)
                chain = [v] + back
                nodes = chain[:-1]
                k = nodes.index(min(nodes))
                key = tuple(nodes[k:] + nodes[:k])
                if key in seen:
                    continue
                seen.add(key)
                ring = list(key) + [key[0]]
                cycles.append([first[(a, b)] for a, b in zip(ring, ring[1:])])
    return cycles


def module_chain(chain: list[Edge]) -> list[str]:
    """The modules of a chain of edges, first to last."""
    return [chain[0].src] + [e.dst for e in chain]


def format_chain(chain: list[Edge]) -> str:
    """`a -> b (a.py:3) -> a (b.py:7)`."""
    return chain[0].src + "".join(f" -> {e.dst} ({e.path}:{e.line})" for e in chain)


def package_of(module: str) -> str:
    """The package-graph node of a module: pallas_kernels, c2jax (the root), or c2jax.<first part>."""
    parts = module.split(".")
    if parts[0] != "c2jax":
        return parts[0]
    return "c2jax" if len(parts) == 1 else f"c2jax.{parts[1]}"


def package_edges(edges: list[Edge]) -> list[Edge]:
    """The module edges that cross packages, as edges between package nodes (each keeps the
    file:line of its import)."""
    return [Edge(package_of(e.src), package_of(e.dst), e.path, e.line) for e in edges
            if package_of(e.src) != package_of(e.dst)]


def _table(text: str, name: str) -> list[list[str]]:
    """Rows (cells) of the markdown table between `<!-- name` and `<!-- /name -->`."""
    m = re.search(rf"<!-- {name}\b.*?-->(.*?)<!-- /{name} -->", text, re.S)
    if not m:
        raise AssertionError(f"{ARCHITECTURE} has no <!-- {name} --> ... <!-- /{name} --> table")
    rows = []
    for line in m.group(1).strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 1 and not set(cells[0]) <= set("-: "):
            rows.append(cells)
    return rows[1:]   # past the header row


def _names(cell: str) -> list[str]:
    return re.findall(r"`([A-Za-z_][\w.]*)`", cell)


def architecture_layers(root: str = ROOT):
    """(layers: [(number, name, [nodes])] lowest first, forbidden: [(node, [nodes], why)]), as
    docs/ARCHITECTURE.md's tables state them."""
    with open(os.path.join(root, ARCHITECTURE)) as f:
        text = f.read()
    layers = [(int(r[0]), r[1], _names(r[2])) for r in _table(text, "import-layers")]
    forbidden = [(_names(r[0])[0], _names(r[1]), r[2]) for r in _table(text, "import-forbidden")]
    return layers, forbidden


def layer_violations(edges: list[Edge], layers, forbidden) -> list[str]:
    """Package edges that go to the node's own layer or a higher one, or to a node it must not
    import; nodes no layer lists."""
    rank = {node: n for n, _, nodes in layers for node in nodes}
    out = []
    nodes = {package_of(e.src) for e in edges} | {package_of(e.dst) for e in edges}
    for node in sorted(nodes - set(rank)):
        out.append(f"{node} is in no layer of {ARCHITECTURE}: add it to the layer table")
    for e in package_edges(edges):
        if e.src in rank and e.dst in rank and rank[e.dst] >= rank[e.src]:
            where = "its own layer" if rank[e.dst] == rank[e.src] else "a higher layer"
            out.append(f"{e.src} (layer {rank[e.src]}) -> {e.dst} (layer {rank[e.dst]}, {where}) ({e.path}:{e.line})")
        for node, banned, why in forbidden:
            if e.src == node and any(e.dst == b or e.dst.startswith(b + ".") for b in banned):
                out.append(f"{e.src} -> {e.dst} ({e.path}:{e.line}): {why}")
    for e in edges:   # pallas_kernels -> c2jax: the root package itself counts too
        for node, banned, why in forbidden:
            if package_of(e.src) == node and package_of(e.dst) != node and "c2jax" in banned \
                    and e.dst.split(".")[0] == "c2jax":
                out.append(f"{e.src} -> {e.dst} ({e.path}:{e.line}): {why}")
    return sorted(set(out))


def test_walk_sees_lazy_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "c2jax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from c2jax.sub.b import g\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from c2jax import c\n"
        "def f():\n    from c2jax.sub import b, g\n    from . import c\n")
    (pkg / "sub" / "b.py").write_text("import c2jax.a\n")
    (pkg / "c.py").write_text("from c2jax.sub.b import x\n")
    edges = {(e.src, e.dst, e.line) for e in import_graph(str(tmp_path))}
    assert edges == {("c2jax.sub", "c2jax.sub.b", 1), ("c2jax.a", "c2jax.sub.b", 5), ("c2jax.a", "c2jax.sub", 5),
                     ("c2jax.a", "c2jax.c", 6), ("c2jax.sub.b", "c2jax.a", 1), ("c2jax.c", "c2jax.sub.b", 1)}
    cycles = {tuple(module_chain(c)) for c in find_cycles(import_graph(str(tmp_path)))}
    assert cycles == {("c2jax.a", "c2jax.sub.b", "c2jax.a"), ("c2jax.a", "c2jax.sub", "c2jax.sub.b", "c2jax.a"),
                      ("c2jax.a", "c2jax.c", "c2jax.sub.b", "c2jax.a")}


def test_package_graph_and_layers_on_a_toy_tree(tmp_path):
    (tmp_path / "c2jax" / "low").mkdir(parents=True)
    (tmp_path / "c2jax" / "high").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "c2jax" / "__init__.py").write_text("")
    (tmp_path / "c2jax" / "base.py").write_text("")
    (tmp_path / "c2jax" / "low" / "__init__.py").write_text("")
    (tmp_path / "c2jax" / "low" / "a.py").write_text("import c2jax.base\ndef f():\n    from c2jax.high import b\n")
    (tmp_path / "c2jax" / "high" / "__init__.py").write_text("")
    (tmp_path / "c2jax" / "high" / "b.py").write_text("from c2jax.low import a\n")
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text(
        "<!-- import-layers -->\n| # | layer | nodes | what |\n|---|---|---|---|\n"
        "| 1 | base | `c2jax` `c2jax.base` | x |\n| 2 | low | `c2jax.low` | x |\n| 3 | high | `c2jax.high` | x |\n"
        "<!-- /import-layers -->\n<!-- import-forbidden -->\n| node | must not | why |\n|---|---|---|\n"
        "| `c2jax.high` | `c2jax.base` | no reason |\n<!-- /import-forbidden -->\n")
    edges = import_graph(str(tmp_path))
    cycles = [format_chain(c) for c in find_cycles(package_edges(edges))]
    assert cycles == ["c2jax.high -> c2jax.low (c2jax/high/b.py:1) -> c2jax.high (c2jax/low/a.py:3)"]
    layers, forbidden = architecture_layers(str(tmp_path))
    assert [n for _, _, n in layers] == [["c2jax", "c2jax.base"], ["c2jax.low"], ["c2jax.high"]]
    assert forbidden == [("c2jax.high", ["c2jax.base"], "no reason")]
    assert layer_violations(edges, layers, forbidden) == [
        "c2jax.low (layer 2) -> c2jax.high (layer 3, a higher layer) (c2jax/low/a.py:3)"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, (f"{len(cycles)} import cycle(s); move the shared piece into a module both import:\n  "
                        + "\n  ".join(format_chain(c) for c in cycles))


def test_no_package_cycles():
    cycles = find_cycles(package_edges(import_graph()))
    assert not cycles, (f"{len(cycles)} package import cycle(s); move the shared piece down a layer or pass it in "
                        f"(see {ARCHITECTURE}):\n  " + "\n  ".join(format_chain(c) for c in cycles))


def test_layers_of_architecture_md():
    layers, forbidden = architecture_layers()
    assert [n for n, _, _ in layers] == list(range(1, len(layers) + 1)), "layers are numbered 1, 2, ... lowest first"
    listed = [node for _, _, nodes in layers for node in nodes]
    assert len(listed) == len(set(listed)), f"a node is in two layers of {ARCHITECTURE}"
    modules = discover_modules()
    bad = layer_violations(import_graph(), layers, forbidden)
    assert not bad, f"{len(bad)} import(s) break the layers of {ARCHITECTURE}:\n  " + "\n  ".join(bad)
    assert set(listed) == {package_of(m) for m in modules}, (
        f"{ARCHITECTURE} lists nodes that do not exist: {sorted(set(listed) - {package_of(m) for m in modules})}")


_MALLOC_PROBE = r"""
import ctypes, json, sys
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
libc.sbrk.argtypes, libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_ssize_t], [ctypes.c_size_t], [ctypes.c_void_p]


def heap_serves_large_blocks():
    # glibc's defaults mmap a 64 MB block (over the 32 MB cap of the mmap threshold); with
    # hostmem's settings (no mmap per allocation) it comes from the brk heap, which grows
    before = libc.sbrk(0)
    p = libc.malloc(64 << 20)
    grown = libc.sbrk(0) - before
    libc.free(p)
    return grown >= 64 << 20


import c2jax
after_import = heap_serves_large_blocks()
hm = sys.modules.get("c2jax.hostmem")
state = hm.state if hm else "hostmem not imported"
from c2jax import hostmem
hostmem.retain_freed_memory()
print(json.dumps({"after_import": after_import, "state": state, "after_retain": heap_serves_large_blocks()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_import_c2jax_changes_no_process_state():
    # the malloc settings of c2jax.hostmem are process-wide; the CLI entry point sets them, not import
    env = {**os.environ, "C2JAX_HOST_MALLOC": "retain", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["after_import"] and got["state"] in ("hostmem not imported", "not attempted"), (
        f"`import c2jax` changed malloc's settings; call hostmem.retain_freed_memory() in an entry point: {got}")
    assert got["after_retain"], f"the probe cannot see hostmem's malloc settings: {got}"
