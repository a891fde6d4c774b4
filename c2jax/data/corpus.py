"""Corpus sources: real code on disk, split by file into train and held-out.

A corpus is described by a `CorpusSpec` (or a plain dict / ConfigDict with the same fields):

    sources = [
        {"kind": "stdlib"},                                   # this interpreter's stdlib sources
        {"kind": "packages", "names": ["numpy"]},             # installed packages, by import name
        {"kind": "dir", "path": "/src/repo", "glob": "**/*.py"},
        {"kind": "git", "path": "/src/checkout", "glob": "*.py"},  # files from `git ls-files`
        {"kind": "jsonl", "path": "/data/*.jsonl", "field": "text"},
        {"kind": "array_record", "path": "/data/x.array_record", "field": None},  # raw utf-8 records
    ]

Every document gets a stable name `"<source>/<relative path>"` (e.g. `stdlib/json/decoder.py`).
Documents are deduplicated by content hash (first one in source order wins), and split into
train / held-out by a hash of that name, so the split does not depend on the machine, on
the order of sources, or on which other files exist. Packages named in `exclude_packages` (the
codebase kept for the perplexity eval, c2jax.data.codebase) are dropped from both splits.
Non-UTF-8, empty and oversized files are skipped and counted in `CorpusStats`, never fatal.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob as globlib
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

SOURCE_KINDS = ("stdlib", "packages", "dir", "git", "jsonl", "array_record")

# Directories (relative to the stdlib root) that are not library code or are tests.
STDLIB_EXCLUDE_DIRS = (
    "test", "site-packages", "dist-packages", "lib-dynload", "__pycache__", "idlelib/Icons",
    "idlelib/idle_test", "lib2to3/tests", "tkinter/test", "unittest/test", "ctypes/test",
    "distutils/tests", "sqlite3/test", "ensurepip/_bundled", "turtledemo",
)
# Directory names skipped anywhere in dir/packages sources.
SKIP_DIR_NAMES = ("__pycache__", ".git", ".hg", ".svn", ".venv", "node_modules", ".mypy_cache",
                  ".pytest_cache", ".tox")


class CorpusError(ValueError):
    """A corpus spec is wrong; the message names the field and says what to do."""


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    # List of source dicts, each with a "kind" in SOURCE_KINDS (see module docstring).
    sources: tuple = ({"kind": "stdlib"},)
    # Files / records larger than this many bytes are skipped (and counted).
    max_file_bytes: int = 1_000_000
    # Fraction of documents (by hash of name) held out from training.
    heldout_fraction: float = 0.02
    # Top-level packages/modules dropped from both splits (e.g. the perplexity codebase).
    exclude_packages: tuple = ()
    # Salt of the name hash that assigns documents to splits.
    split_salt: str = "c2jax"

    def __post_init__(self):
        object.__setattr__(self, "sources", tuple(_plain(s) for s in self.sources))
        object.__setattr__(self, "exclude_packages", tuple(self.exclude_packages))
        validate_spec(self)

    @classmethod
    def from_config(cls, cfg: Any, extra_exclude: Sequence[str] = ()) -> CorpusSpec:
        """Builds a spec from a CorpusSpec, dict or ml_collections ConfigDict (extra keys ignored)."""
        if isinstance(cfg, CorpusSpec):
            fields = dataclasses.asdict(cfg)
        else:
            names = {f.name for f in dataclasses.fields(cls)}
            get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
            fields = {n: get(n) for n in names if get(n) is not None}
        excl = tuple(fields.get("exclude_packages", ()) or ())
        fields["exclude_packages"] = excl + tuple(p for p in extra_exclude if p and p not in excl)
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)


def _plain(x: Any) -> Any:
    """ConfigDict / FrozenConfigDict / Mapping -> plain dict (recursively), tuples -> lists."""
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def validate_spec(spec: CorpusSpec) -> None:
    if not spec.sources:
        raise CorpusError("corpus.sources is empty: give at least one source, e.g. [{'kind': 'stdlib'}]")
    for i, src in enumerate(spec.sources):
        if not isinstance(src, dict) or "kind" not in src:
            raise CorpusError(f"corpus.sources[{i}] must be a dict with a 'kind' key, got {src!r}")
        kind = src["kind"]
        if kind not in SOURCE_KINDS:
            raise CorpusError(f"corpus.sources[{i}].kind={kind!r}: use one of {SOURCE_KINDS}")
        if kind in ("dir", "git", "jsonl", "array_record") and not src.get("path"):
            raise CorpusError(f"corpus.sources[{i}] (kind={kind!r}) needs a 'path'")
        if kind == "packages" and not src.get("names"):
            raise CorpusError(f"corpus.sources[{i}] (kind='packages') needs 'names': a list of import names")
    if not 0.0 <= spec.heldout_fraction < 1.0:
        raise CorpusError(f"corpus.heldout_fraction={spec.heldout_fraction}: must be in [0, 1)")
    if spec.max_file_bytes <= 0:
        raise CorpusError(f"corpus.max_file_bytes={spec.max_file_bytes}: must be positive")


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # stable name "<source>/<relative path>", used for the split and for messages
    text: str
    sha: str  # sha256 hex of the UTF-8 bytes


@dataclasses.dataclass
class CorpusStats:
    seen: int = 0               # files / records looked at
    train_docs: int = 0
    heldout_docs: int = 0
    train_bytes: int = 0
    heldout_bytes: int = 0
    skipped_non_utf8: int = 0
    skipped_too_large: int = 0
    skipped_empty: int = 0
    skipped_duplicate: int = 0
    skipped_excluded: int = 0   # in exclude_packages
    skipped_unreadable: int = 0  # OSError, bad JSON line, missing field
    examples: dict = dataclasses.field(default_factory=dict)  # reason -> first few names

    def skip(self, reason: str, name: str) -> None:
        setattr(self, f"skipped_{reason}", getattr(self, f"skipped_{reason}") + 1)
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 5:
            ex.append(name)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Corpus:
    spec: CorpusSpec
    train: list[Document]
    heldout: list[Document]
    stats: CorpusStats

    def split(self, name: str) -> list[Document]:
        if name not in ("train", "heldout"):
            raise CorpusError(f"split={name!r}: use 'train' or 'heldout'")
        return self.train if name == "train" else self.heldout

    def fingerprint(self, split: str | None = None) -> str:
        """Hash of the spec and the (name, content hash) of every document (of one split)."""
        h = hashlib.sha256(self.spec.to_json().encode())
        for s in ([split] if split else ["train", "heldout"]):
            h.update(f"|{s}|".encode())
            for d in self.split(s):
                h.update(f"{d.name}\0{d.sha}\n".encode())
        return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Sources. Each yields (name, raw bytes or None, size); bytes are decoded centrally.


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _walk_files(root: str, pattern: str, exclude_dirs: Sequence[str] = ()) -> list[str]:
    """Sorted relative paths under root matching a glob (`**/` = any depth).

    exclude_dirs: "a/b" skips that relative directory; a bare name "tests" skips every
    directory of that name at any depth.
    """
    out = []
    excl = tuple(e.rstrip("/") for e in exclude_dirs)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in dirnames:
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if d in SKIP_DIR_NAMES or rel in excl or d in excl:
                continue
            keep.append(d)
        dirnames[:] = sorted(keep)
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if _glob_match(rel, pattern):
                out.append(rel)
    return sorted(out)


def _glob_match(rel: str, pattern: str) -> bool:
    """fnmatch on the relative path; a leading "**/" means "at any depth, including the top"."""
    if pattern.startswith("**/"):
        rest, parts = pattern[3:], rel.split("/")
        return any(fnmatch.fnmatchcase("/".join(parts[i:]), rest) for i in range(len(parts)))
    return fnmatch.fnmatchcase(rel, pattern)


def _read_files(root: str, rels: Sequence[str], prefix: str, max_bytes: int, stats: CorpusStats):
    for rel in rels:
        name = f"{prefix}/{rel}"
        path = os.path.join(root, rel)
        try:
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            size = os.path.getsize(path)
            if size > max_bytes:
                stats.seen += 1
                stats.skip("too_large", name)
                continue
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            stats.seen += 1
            stats.skip("unreadable", name)
            continue
        yield name, data


def _source_stdlib(src: dict, spec: CorpusSpec, stats: CorpusStats):
    root = src.get("path") or stdlib_dir()
    rels = _walk_files(root, src.get("glob", "**/*.py"),
                       tuple(STDLIB_EXCLUDE_DIRS) + tuple(src.get("exclude_dirs", ())))
    yield from _read_files(root, rels, src.get("name", "stdlib"), spec.max_file_bytes, stats)


def _source_packages(src: dict, spec: CorpusSpec, stats: CorpusStats):
    import importlib.util

    for pkg in src["names"]:
        try:
            found = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            found = None
        if found is None or not found.origin:
            raise CorpusError(f"corpus source 'packages': cannot find installed package {pkg!r}; "
                              f"install it or remove it from 'names'")
        if found.submodule_search_locations:  # a package directory
            root = next(iter(found.submodule_search_locations))
            rels = _walk_files(root, src.get("glob", "**/*.py"), tuple(src.get("exclude_dirs", ("tests", "test"))))
            yield from _read_files(root, rels, f"pkg/{pkg}", spec.max_file_bytes, stats)
        else:  # a single module file
            root, fname = os.path.split(found.origin)
            yield from _read_files(root, [fname], "pkg", spec.max_file_bytes, stats)


def _source_dir(src: dict, spec: CorpusSpec, stats: CorpusStats):
    root = os.path.abspath(os.path.expanduser(src["path"]))
    if not os.path.isdir(root):
        raise CorpusError(f"corpus source dir: {root!r} is not a directory")
    rels = _walk_files(root, src.get("glob", "**/*"), tuple(src.get("exclude_dirs", ())))
    yield from _read_files(root, rels, src.get("name") or os.path.basename(root), spec.max_file_bytes, stats)


def _source_git(src: dict, spec: CorpusSpec, stats: CorpusStats):
    root = os.path.abspath(os.path.expanduser(src["path"]))
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CorpusError(f"corpus source git: `git ls-files` failed in {root!r} "
                          f"(is it a git checkout?): {getattr(e, 'stderr', b'')!r}") from e
    pattern = src.get("glob", "**/*")
    rels = sorted(r for r in out.decode("utf-8", "surrogateescape").split("\0")
                  if r and not r.startswith(".git/") and _glob_match(r, pattern))
    yield from _read_files(root, rels, src.get("name") or os.path.basename(root), spec.max_file_bytes, stats)


def _expand_paths(path: str) -> list[str]:
    paths = sorted(globlib.glob(os.path.expanduser(path)))
    if not paths:
        raise CorpusError(f"corpus source: no file matches path {path!r}")
    return paths


def _record_text(rec: bytes, field: str | None, name: str, stats: CorpusStats):
    """Raw bytes (field None) or the JSON field of a record -> (bytes or None)."""
    if field is None:
        return rec
    try:
        obj = json.loads(rec)
        val = obj[field]
    except (ValueError, KeyError, TypeError):
        stats.seen += 1
        stats.skip("unreadable", name)
        return None
    if not isinstance(val, str):
        stats.seen += 1
        stats.skip("unreadable", name)
        return None
    return val.encode("utf-8", "surrogatepass")


def _source_jsonl(src: dict, spec: CorpusSpec, stats: CorpusStats):
    field = src.get("field", "text")
    for path in _expand_paths(src["path"]):
        base = src.get("name") or os.path.basename(path)
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                name = f"{base}:{lineno}"
                if len(line) > spec.max_file_bytes * 2 + 1024:  # escaped JSON may be ~2x the text
                    stats.seen += 1
                    stats.skip("too_large", name)
                    continue
                data = _record_text(line, field, name, stats)
                if data is not None:
                    yield name, data


def _source_array_record(src: dict, spec: CorpusSpec, stats: CorpusStats):
    from array_record.python import array_record_module as arm

    field = src.get("field")  # None: each record is raw UTF-8 text
    for path in _expand_paths(src["path"]):
        base = src.get("name") or os.path.basename(path)
        reader = arm.ArrayRecordReader(path)
        try:
            n = reader.num_records()
            for start in range(0, n, 1024):
                for j, rec in enumerate(reader.read(list(range(start, min(n, start + 1024))))):
                    name = f"{base}:{start + j}"
                    data = _record_text(rec, field, name, stats)
                    if data is not None:
                        yield name, data
        finally:
            reader.close()


_SOURCES = {
    "stdlib": _source_stdlib, "packages": _source_packages, "dir": _source_dir,
    "git": _source_git, "jsonl": _source_jsonl, "array_record": _source_array_record,
}


# ---------------------------------------------------------------------------------------------


def top_package(name: str) -> str:
    """'stdlib/json/decoder.py' -> 'json'; 'stdlib/abc.py' -> 'abc'; 'pkg/numpy/x.py' -> 'numpy'."""
    parts = name.split("/")
    rel = parts[1:] if len(parts) > 1 else parts
    return rel[0].removesuffix(".py")


def heldout_by_name(name: str, fraction: float, salt: str = "c2jax") -> bool:
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{salt}\0{name}".encode()).digest()[:8], "big")
    return h / 2.0**64 < fraction


def iter_documents(spec: CorpusSpec, stats: CorpusStats | None = None) -> Iterator[tuple[str, Document]]:
    """Yields (split, Document) for every kept document, in source order, deduplicated."""
    stats = stats if stats is not None else CorpusStats()
    seen_sha: set[bytes] = set()
    excluded = set(spec.exclude_packages)
    for src in spec.sources:
        for name, data in _SOURCES[src["kind"]](src, spec, stats):
            stats.seen += 1
            if excluded and top_package(name) in excluded:
                stats.skip("excluded", name)
                continue
            if len(data) > spec.max_file_bytes:
                stats.skip("too_large", name)
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                stats.skip("non_utf8", name)
                continue
            if not text.strip():
                stats.skip("empty", name)
                continue
            digest = hashlib.sha256(data).digest()
            if digest in seen_sha:
                stats.skip("duplicate", name)
                continue
            seen_sha.add(digest)
            doc = Document(name=name, text=text, sha=digest.hex())
            if heldout_by_name(name, spec.heldout_fraction, spec.split_salt):
                stats.heldout_docs += 1
                stats.heldout_bytes += len(data)
                yield "heldout", doc
            else:
                stats.train_docs += 1
                stats.train_bytes += len(data)
                yield "train", doc


def build_corpus(spec: CorpusSpec | Mapping | Any = None) -> Corpus:
    """Reads every source into memory (fine for the stdlib: ~14 MB) and returns both splits."""
    spec = CorpusSpec() if spec is None else (spec if isinstance(spec, CorpusSpec) else CorpusSpec.from_config(spec))
    stats = CorpusStats()
    train, heldout = [], []
    for split, doc in iter_documents(spec, stats):
        (train if split == "train" else heldout).append(doc)
    if not train:
        raise CorpusError(f"the corpus has no training documents (stats: {stats.as_dict()}); "
                          f"check corpus.sources and corpus.exclude_packages")
    return Corpus(spec=spec, train=train, heldout=heldout, stats=stats)


def main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - manual inspection
    import time

    t = time.time()
    c = build_corpus()
    print(json.dumps(c.stats.as_dict(), indent=1), f"{time.time() - t:.2f}s", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    main()
