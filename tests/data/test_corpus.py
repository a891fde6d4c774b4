import json
import os
import subprocess

import pytest

from c2jax.data.corpus import (
    CorpusError,
    CorpusSpec,
    build_corpus,
    heldout_by_name,
    top_package,
)


def _write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_skips_are_counted_not_fatal(tmp_path):
    root = tmp_path / "repo"
    _write(str(root / "good.py"), b"x = 1\n")
    _write(str(root / "pkg" / "also_good.py"), "s = 'héllo'\n".encode())
    _write(str(root / "bad.py"), b"x = '\xff\xfe\xfa'\n")          # not UTF-8
    _write(str(root / "big.py"), b"y = 2\n" * 1000)                # 6000 bytes > 4096
    _write(str(root / "empty.py"), b"\n  \n")
    _write(str(root / "dup.py"), b"x = 1\n")                       # same content as good.py
    _write(str(root / "notes.txt"), b"not matched by the glob\n")
    _write(str(root / "__pycache__" / "c.py"), b"z = 3\n")          # skipped dir
    spec = CorpusSpec(sources=[{"kind": "dir", "path": str(root), "glob": "**/*.py"}],
                      max_file_bytes=4096, heldout_fraction=0.0)
    c = build_corpus(spec)
    s = c.stats
    assert (s.skipped_non_utf8, s.skipped_too_large, s.skipped_empty, s.skipped_duplicate) == (1, 1, 1, 1)
    assert [d.name for d in c.train] == ["repo/dup.py", "repo/pkg/also_good.py"]  # path order; first copy wins
    assert s.examples["duplicate"] == ["repo/good.py"]
    assert s.seen == 6 and s.train_docs == 2 and s.heldout_docs == 0
    assert s.examples["non_utf8"] == ["repo/bad.py"]


def test_stdlib_split_excludes_package_and_is_deterministic():
    spec = CorpusSpec(exclude_packages=("json",), heldout_fraction=0.05)
    c = build_corpus(spec)
    names = [d.name for d in c.train] + [d.name for d in c.heldout]
    assert not any(top_package(n) == "json" for n in names)
    assert c.stats.skipped_excluded >= 5  # json/*.py
    assert "stdlib/os.py" in names and "stdlib/asyncio/events.py" in names
    assert not any("/test/" in n or n.startswith("stdlib/test/") for n in names)
    assert not {d.name for d in c.train} & {d.name for d in c.heldout}
    assert 0 < len(c.heldout) < 0.15 * len(names)
    assert all(heldout_by_name(d.name, 0.05) for d in c.heldout)
    c2 = build_corpus(spec)
    assert c2.fingerprint() == c.fingerprint()
    assert len({d.sha for d in c.train}) == len(c.train)  # deduplicated


def test_jsonl_and_array_record_sources(tmp_path):
    from array_record.python import array_record_module as arm

    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join([json.dumps({"content": "a = 1"}), "{broken", json.dumps({"other": 1}),
                             json.dumps({"content": "b = 2"})]) + "\n")
    ar = str(tmp_path / "docs.array_record")
    w = arm.ArrayRecordWriter(ar, "group_size:1")
    for rec in [b"c = 3", b"\xff\xff", "d = 'ü'".encode()]:
        w.write(rec)
    w.close()
    spec = CorpusSpec(sources=[{"kind": "jsonl", "path": str(jl), "field": "content"},
                               {"kind": "array_record", "path": ar}], heldout_fraction=0.0)
    c = build_corpus(spec)
    assert [d.text for d in c.train] == ["a = 1", "b = 2", "c = 3", "d = 'ü'"]
    assert c.stats.skipped_unreadable == 2 and c.stats.skipped_non_utf8 == 1


def test_git_source_uses_tracked_files_only(tmp_path):
    repo = tmp_path / "checkout"
    _write(str(repo / "tracked.py"), b"t = 1\n")
    _write(str(repo / "sub" / "tracked2.py"), b"t = 2\n")
    _write(str(repo / "untracked.py"), b"u = 1\n")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_SYSTEM": "/dev/null"}
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.py", "sub/tracked2.py"], check=True, env=env)
    c = build_corpus({"sources": [{"kind": "git", "path": str(repo), "glob": "**/*.py"}],
                      "heldout_fraction": 0.0})
    assert [d.name for d in c.train] == ["checkout/sub/tracked2.py", "checkout/tracked.py"]


def test_bad_specs_name_the_field(tmp_path):
    with pytest.raises(CorpusError, match="kind"):
        CorpusSpec(sources=[{"kind": "ftp"}])
    with pytest.raises(CorpusError, match="heldout_fraction"):
        CorpusSpec(heldout_fraction=1.5)
    with pytest.raises(CorpusError, match="path"):
        CorpusSpec(sources=[{"kind": "dir"}])
    with pytest.raises(CorpusError, match="no file matches"):
        build_corpus({"sources": [{"kind": "jsonl", "path": str(tmp_path / "nope*.jsonl")}]})


def test_packages_source():
    c = build_corpus({"sources": [{"kind": "packages", "names": ["absl"]}], "heldout_fraction": 0.0})
    assert c.train and all(d.name.startswith("pkg/absl/") for d in c.train)
    assert top_package(c.train[0].name) == "absl"
