import concurrent.futures
import os
import time
from pathlib import Path

import pytest

from c2jax.agent import tools as tl
from c2jax.agent.chat_format import CallError, ToolCall


@pytest.fixture
def ctx(sandbox, workdir):
    (workdir / "pkg").mkdir()
    (workdir / "pkg" / "mod.py").write_text("def f():\n    return 1\n\n\ndef g():\n    return 1\n")
    (workdir / "test_mod.py").write_text("import pkg.mod as m\n\ndef test_f():\n    assert m.f() == 1\n")
    uid = sandbox.prepare_dir(workdir)
    return tl.ToolContext(root=workdir, sandbox=sandbox, uid=uid if os.geteuid() == 0 else None,
                          max_output_chars=4000, run_timeout_s=5)


def call(ctx, name, tools=None, **args):
    return tl.execute_one(ToolCall(0, name, args), tools or tl.ALL_TOOLS, ctx)


def test_read_file_ranges(ctx):
    r = call(ctx, "read_file", path="pkg/mod.py", start_line=2, end_line=2)
    assert r.ok and "2|     return 1" in r.output and "def f" not in r.output
    assert call(ctx, "read_file", path="/task/pkg/mod.py").ok
    for bad in ({"start_line": 0}, {"start_line": 3, "end_line": 2}, {"start_line": 99}):
        r = call(ctx, "read_file", path="pkg/mod.py", **bad)
        assert not r.ok and not r.malformed
    assert "does not exist" in call(ctx, "read_file", path="nope.py").output
    assert "directory" in call(ctx, "read_file", path="pkg").output


def test_paths_outside_repo_rejected(ctx):
    for p in ("../x", "/etc/passwd", "pkg/../../x", "", "a\0b"):
        r = call(ctx, "read_file", path=p)
        assert not r.ok, p


def test_list_dir_and_grep(ctx):
    r = call(ctx, "list_dir", recursive=True)
    assert r.ok and "pkg/" in r.output and "pkg/mod.py" in r.output
    r = call(ctx, "grep", pattern=r"def [fg]\(", path="pkg")
    assert r.ok and "mod.py:1:def f():" in r.output and "mod.py:5:def g():" in r.output
    assert call(ctx, "grep", pattern="zzz_nothing").output == "(no matches)"
    r = call(ctx, "grep", pattern="(unclosed")
    assert not r.ok


def test_edit_file_unique_match(ctx):
    r = call(ctx, "edit_file", path="pkg/mod.py", old="return 1", new="return 2")
    assert not r.ok and "2 times" in r.output
    r = call(ctx, "edit_file", path="pkg/mod.py", old="def g():\n    return 1", new="def g():\n    return 2")
    assert r.ok, r.output
    assert (ctx.root / "pkg/mod.py").read_text().endswith("def g():\n    return 2\n")
    assert "not found" in call(ctx, "edit_file", path="pkg/mod.py", old="nope", new="x").output
    assert not call(ctx, "edit_file", path="pkg/mod.py", old="x", new="x").ok
    if ctx.uid is not None:  # files the harness writes stay editable by the sandbox user
        assert (ctx.root / "pkg/mod.py").stat().st_uid == ctx.uid


def test_edit_file_miss_quotes_the_closest_text(ctx):
    """A miscopied 'old' gets the file's closest span back, exact and copyable; the retry with it
    applies. Nothing alike gets no hint; exact matching stays the rule."""
    (ctx.root / "pkg/calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef sub(x, y):\n    return x + y\n")
    r = call(ctx, "edit_file", path="pkg/calc.py", old="    retrun a - b", new="    return a + b")
    assert not r.ok and "not found" in r.output
    hint = r.output.split("is:\n", 1)[1]
    assert "at line 2" in r.output and hint.startswith("    return a - b")
    assert (ctx.root / "pkg/calc.py").read_text().count("a - b") == 1  # nothing applied
    r = call(ctx, "edit_file", path="pkg/calc.py", old="def sub(x, y):\n  return x + y", new="x")
    assert "at line 5" in r.output and r.output.endswith("def sub(x, y):\n    return x + y")
    assert call(ctx, "edit_file", path="pkg/calc.py", old=hint.splitlines()[0], new="    return a + b").ok
    assert "closest" not in call(ctx, "edit_file", path="pkg/calc.py", old="zzzzzzzzzzzzqqqq", new="x").output
    assert tl.closest_text_hint("", "x") == "" and tl.closest_text_hint("a\n" * 6000, "a") == ""


def test_write_file_then_run_and_run_tests(ctx):
    r = call(ctx, "write_file", path="new/dir/x.py", content="print('hi from x')\n")
    assert r.ok, r.output
    if ctx.uid is not None:
        assert (ctx.root / "new" / "dir").stat().st_uid == ctx.uid
    r = call(ctx, "run", command="python3 new/dir/x.py && echo more >> new/dir/x.py")
    assert r.ok and "exit code: 0" in r.output and "hi from x" in r.output
    r = call(ctx, "run", command="exit 3")
    assert r.ok and "exit code: 3" in r.output
    r = call(ctx, "run", command="sleep 5", timeout_s=0.5)
    assert "killed: wall_clock" in r.output
    assert call(ctx, "run", command="ls", timeout_s=100).malformed is False
    assert not call(ctx, "run", command="ls", timeout_s=100).ok
    r = call(ctx, "run_tests")
    assert r.ok and "1 passed" in r.output, r.output


def test_output_is_truncated(ctx):
    r = call(ctx, "run", command="python3 -c \"print('x' * 50000)\"")
    assert len(r.output) < ctx.max_output_chars + 200 and "omitted" in r.output


def test_symlink_and_fifo_escapes_refused(ctx):
    r = call(ctx, "run", command="ln -s /etc/passwd leak; ln -s / rootlink; ln -s /etc etclink; mkfifo pipe; ls")
    assert "leak" in r.output
    before = Path("/etc/passwd").read_text()
    for name, args in [("read_file", {"path": "leak"}), ("read_file", {"path": "rootlink/etc/passwd"}),
                       ("write_file", {"path": "leak", "content": "pwned"}),
                       ("write_file", {"path": "etclink/c2jax_pwned", "content": "pwned"}),
                       ("edit_file", {"path": "leak", "old": "root", "new": "toor"}),
                       ("list_dir", {"path": "rootlink"})]:
        r = call(ctx, name, **args)
        assert not r.ok and "root:" not in r.output, (name, r.output)
    t0 = time.monotonic()
    r = call(ctx, "read_file", path="pipe")
    assert not r.ok and time.monotonic() - t0 < 2
    assert Path("/etc/passwd").read_text() == before
    assert not os.path.exists("/etc/c2jax_pwned")


def test_argument_checks_are_strict(ctx):
    bad = [("read_file", {"path": "a", "line": 3}), ("read_file", {}), ("read_file", {"path": 3}),
           ("read_file", {"path": "a", "start_line": True}), ("run", {"command": ["ls"]}),
           ("nonexistent_tool", {})]
    for name, args in bad:
        r = tl.execute_one(ToolCall(0, name, args), tl.ALL_TOOLS, ctx)
        assert r.malformed and not r.ok, (name, args)


def test_toolsets_and_internal_errors(ctx, monkeypatch):
    only_read = tl.make_toolset(["read_file", "list_dir"])
    r = call(ctx, "run", tools=only_read, command="ls")
    assert r.malformed and "available: read_file, list_dir" in r.output
    with pytest.raises(ValueError, match="unknown tool"):
        tl.make_toolset(["read_file", "teleport"])

    def boom(ctx, args):
        raise RuntimeError("tool bug")

    tools = dict(tl.ALL_TOOLS)
    tools["list_dir"] = tl.Tool("list_dir", "", {}, boom)
    r = call(ctx, "list_dir", tools=tools)
    assert r.internal_error and not r.ok and "tool bug" in r.output


def test_parallel_calls_overlap_and_edits_keep_order(ctx):
    stamp = "echo $(date +%s.%N) $(sleep 1; date +%s.%N) done"
    calls = [ToolCall(i, "run", {"command": stamp}) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        res = tl.execute_calls(calls, [], tl.ALL_TOOLS, ctx, ex)
        assert [r.index for r in res] == [0, 1, 2, 3] and all("done" in r.output for r in res)
        spans = [tuple(float(x) for x in r.output.split("done")[0].split()[-2:]) for r in res]
        # the sleeps ran together (stamped inside the sandbox), not one after another
        assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) >= 3, spans
        edits = [ToolCall(0, "write_file", {"path": "o.txt", "content": "a"}),
                 ToolCall(2, "edit_file", {"path": "o.txt", "old": "a", "new": "ab"}),
                 ToolCall(3, "edit_file", {"path": "o.txt", "old": "ab", "new": "abc"}),
                 ToolCall(4, "read_file", {"path": "o.txt"})]
        res = tl.execute_calls(edits, [CallError(1, "", "bad json", "{")], tl.ALL_TOOLS, ctx, ex)
        assert [r.index for r in res] == [0, 1, 2, 3, 4]
        assert res[1].malformed and all(r.ok for i, r in enumerate(res) if i != 1)
        assert "1| abc" in res[4].output
