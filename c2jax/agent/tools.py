"""The agent's tools: read_file, list_dir, grep, edit_file, write_file, run, run_tests, todo.

File tools run in the harness but never follow a symlink: every path is walked one
component at a time with O_NOFOLLOW from an fd of the workspace, so a link the model made
with `run` (ln -s /etc/shadow x) cannot reach host files. grep, run and run_tests execute
inside the sandbox. `todo` keeps the episode's to-do list (c2jax.agent.todos), held in the
ToolContext. Arguments are checked strictly (unknown keys, wrong types, missing
required ones, bad ranges are errors returned to the model). Calls in one turn run together;
edit_file / write_file / todo act as barriers so changes apply in the order they were written.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from c2jax.agent.chat_format import CallError, ToolCall
from c2jax.agent.todos import TodoError, TodoList

MAX_READ_BYTES = 2 << 20
MAX_WRITE_CHARS = 1 << 20
MAX_LIST_ENTRIES = 500
SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".c2jax_hidden"})


class ToolError(Exception):
    """An error the model caused; its message goes back to the model."""


@dataclasses.dataclass
class Param:
    type: str            # "string" | "integer" | "boolean" | "number"
    required: bool = False
    description: str = ""


@dataclasses.dataclass
class Tool:
    name: str
    description: str
    params: dict[str, Param]
    handler: Callable[[ToolContext, dict], str]
    mutating: bool = False   # edit/write: barrier for parallel execution

    def spec(self) -> dict:
        return {"name": self.name, "description": self.description,
                "parameters": {k: {"type": p.type, "required": p.required, "description": p.description}
                               for k, p in self.params.items()}}


@dataclasses.dataclass
class ToolContext:
    root: Path                      # the workspace repository (mounted at /task)
    sandbox: Any                    # c2jax.agent.sandbox.Sandbox (or a fake with .run)
    uid: int | None = None          # owner for files the harness writes (sandbox uid)
    max_output_chars: int = 8000    # per tool result
    run_timeout_s: float = 30.0     # cap on `run` / `run_tests`
    test_command: tuple[str, ...] = ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider")
    todos: TodoList = dataclasses.field(default_factory=TodoList)   # the episode's to-do list


@dataclasses.dataclass
class ToolResult:
    index: int
    name: str
    ok: bool
    output: str
    malformed: bool = False         # bad JSON, unknown tool, bad arguments, oversize
    internal_error: bool = False    # an unexpected exception inside the tool
    wall_s: float = 0.0


_TYPES = {"string": (str,), "integer": (int,), "boolean": (bool,), "number": (int, float)}


def check_args(tool: Tool, args: dict) -> None:
    unknown = set(args) - set(tool.params)
    if unknown:
        raise ToolError(f"{tool.name}: unknown argument(s) {sorted(unknown)}; expected "
                        f"{sorted(tool.params)}")
    for k, p in tool.params.items():
        if k not in args:
            if p.required:
                raise ToolError(f"{tool.name}: missing required argument {k!r} ({p.type})")
            continue
        v = args[k]
        ok = isinstance(v, _TYPES[p.type]) and not (p.type in ("integer", "number") and isinstance(v, bool))
        if not ok:
            raise ToolError(f"{tool.name}: argument {k!r} must be a {p.type}, got {type(v).__name__}")


# ----- safe path handling -----------------------------------------------------------------
def split_rel(path: str) -> list[str]:
    """Validates a model-given path; returns its components relative to the workspace."""
    if not path or len(path) > 4096 or "\0" in path:
        raise ToolError("path must be a non-empty string without NUL bytes (at most 4096 chars)")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError("path is not valid UTF-8 text") from None
    p = path.strip()
    if p.startswith("/task/") or p == "/task":
        p = p[len("/task"):].lstrip("/") or "."
    if p.startswith("/"):
        raise ToolError(f"path {path!r} is outside the repository; use a path relative to it (or under /task)")
    parts = [c for c in p.split("/") if c not in ("", ".")]
    if ".." in parts:
        raise ToolError(f"path {path!r} may not contain '..'")
    return parts


def _open_dir(ctx: ToolContext, parts: list[str], create: bool = False) -> int:
    """fd of the directory `parts` inside the workspace; never follows symlinks."""
    fd = os.open(ctx.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for i, part in enumerate(parts):
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise ToolError(f"directory {'/'.join(parts[:i + 1])!r} does not exist") from None
                os.mkdir(part, 0o755, dir_fd=fd)
                if ctx.uid is not None:
                    os.chown(part, ctx.uid, ctx.uid, dir_fd=fd, follow_symlinks=False)
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ToolError(f"{'/'.join(parts[:i + 1])!r} is not a directory (symlinks are not "
                                    "followed)") from None
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_file(ctx: ToolContext, parts: list[str], flags: int, label: str, create_dirs: bool = False) -> int:
    """fd of the file `parts` inside the workspace, opened with `flags`; never follows symlinks."""
    dfd = _open_dir(ctx, parts[:-1], create=create_dirs)
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=dfd)
    except FileNotFoundError:
        raise ToolError(f"file {label!r} does not exist") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ToolError(f"{label!r} is a symlink; symlinks are not followed") from None
        if e.errno == errno.EISDIR:
            raise ToolError(f"{label!r} is a directory") from None
        raise
    finally:
        os.close(dfd)


def _read_text(ctx: ToolContext, path: str) -> tuple[str, list[str]]:
    parts = split_rel(path)
    if not parts:
        raise ToolError("path is a directory; use list_dir")
    fd = _open_file(ctx, parts, os.O_RDONLY, path)
    try:
        st_ = os.fstat(fd)
        if stat.S_ISDIR(st_.st_mode):
            raise ToolError(f"{path!r} is a directory; use list_dir")
        if not stat.S_ISREG(st_.st_mode):
            raise ToolError(f"{path!r} is not a regular file")
        if st_.st_nlink > 1:
            raise ToolError(f"{path!r} has hard links; refusing to read it")
        if st_.st_size > MAX_READ_BYTES:
            raise ToolError(f"{path!r} is {st_.st_size} bytes; files over {MAX_READ_BYTES} are not read")
        data = os.read(fd, MAX_READ_BYTES + 1)
    finally:
        os.close(fd)
    if b"\0" in data[:8192]:
        raise ToolError(f"{path!r} looks binary")
    return data.decode("utf-8", "replace"), parts


def _write_text(ctx: ToolContext, parts: list[str], text: str, create_dirs: bool) -> None:
    label = "/".join(parts)
    fd = _open_file(ctx, parts, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, label, create_dirs)
    try:
        st_ = os.fstat(fd)
        if not stat.S_ISREG(st_.st_mode) or st_.st_nlink > 1:
            raise ToolError(f"{label!r} is not a plain regular file")
        if ctx.uid is not None:
            os.fchown(fd, ctx.uid, ctx.uid)
        data = text.encode("utf-8", "replace")
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)


def truncate_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n... [{len(text) - limit} characters omitted] ...\n{text[-tail:]}"


# ----- tool handlers ----------------------------------------------------------------------
def _read_file(ctx: ToolContext, a: dict) -> str:
    text, _ = _read_text(ctx, a["path"])
    lines = text.splitlines()
    start = a.get("start_line", 1)
    end = a.get("end_line", len(lines))
    if start < 1 or end < start:
        raise ToolError(f"read_file: need 1 <= start_line <= end_line, got {start}..{end}")
    if lines and start > len(lines):
        raise ToolError(f"read_file: start_line {start} is past the end ({len(lines)} lines)")
    end = min(end, len(lines))
    width = len(str(end))
    body = "\n".join(f"{i:>{width}}| {lines[i - 1]}" for i in range(start, end + 1))
    return f"{a['path']} (lines {start}-{end} of {len(lines)})\n{body}" if lines else f"{a['path']} (empty)"


def _list_dir(ctx: ToolContext, a: dict) -> str:
    parts = split_rel(a.get("path", "."))
    recursive = a.get("recursive", False)
    fd = _open_dir(ctx, parts)
    out: list[str] = []

    def walk(dfd: int, prefix: str, depth: int):
        with os.scandir(dfd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if len(out) >= MAX_LIST_ENTRIES:
                return
            if e.name in SKIP_DIRS:
                continue
            if e.is_symlink():
                out.append(f"{prefix}{e.name} -> (symlink)")
            elif e.is_dir(follow_symlinks=False):
                out.append(f"{prefix}{e.name}/")
                if recursive and depth < 8:
                    sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                    try:
                        walk(sub, f"{prefix}{e.name}/", depth + 1)
                    finally:
                        os.close(sub)
            else:
                out.append(f"{prefix}{e.name}")

    try:
        walk(fd, "", 0)
    finally:
        os.close(fd)
    if len(out) >= MAX_LIST_ENTRIES:
        out.append(f"... (stopped at {MAX_LIST_ENTRIES} entries)")
    return "\n".join(out) if out else "(empty directory)"


def _grep(ctx: ToolContext, a: dict) -> str:
    pattern = a["pattern"]
    if not pattern or len(pattern) > 1000:
        raise ToolError("grep: pattern must be 1..1000 characters")
    parts = split_rel(a.get("path", "."))
    argv = ["grep", "-rnIE", "--color=never", "-m", "100"]
    for d in sorted(SKIP_DIRS):
        argv.append(f"--exclude-dir={d}")
    if "include" in a:
        argv.append(f"--include={a['include']}")
    argv += ["--", pattern, "/".join(parts) or "."]
    r = ctx.sandbox.run(argv, ctx.root, timeout_s=min(10.0, ctx.run_timeout_s))
    if r.returncode == 1 and not r.stderr:
        return "(no matches)"
    if r.returncode not in (0, 1) or r.killed_reason:
        raise ToolError(f"grep failed (exit {r.returncode}{', ' + r.killed_reason if r.killed_reason else ''}): "
                        f"{r.stderr.strip()[:500]}")
    return r.stdout


HINT_MAX_CHARS = 600


def closest_text_hint(text: str, old: str) -> str:
    """The span of `text` most like `old` (as many whole lines as `old` has), quoted exactly with
    its first line number, so a retry can copy it; "" when nothing is alike (ratio < 0.5)."""
    import difflib
    lines = text.splitlines(keepends=True)
    n = max(1, old.rstrip("\n").count("\n") + 1)
    if not lines or len(lines) > 5000:
        return ""
    target = old.strip("\n")
    best, best_i = 0.0, -1
    for i in range(max(1, len(lines) - n + 1)):
        cand = "".join(lines[i:i + n]).strip("\n")
        m = difflib.SequenceMatcher(None, target, cand, autojunk=False)
        if m.real_quick_ratio() <= best or m.quick_ratio() <= best:
            continue
        r = m.ratio()
        if r > best:
            best, best_i = r, i
    if best < 0.5:
        return ""
    span = "".join(lines[best_i:best_i + n]).rstrip("\n")
    if len(span) > HINT_MAX_CHARS:
        return ""
    return f"; the closest text in the file, at line {best_i + 1}, is:\n{span}"


def _edit_file(ctx: ToolContext, a: dict) -> str:
    old, new = a["old"], a["new"]
    if not old:
        raise ToolError("edit_file: 'old' must be non-empty (use write_file to create a file)")
    if old == new:
        raise ToolError("edit_file: 'old' and 'new' are identical")
    text, parts = _read_text(ctx, a["path"])
    n = text.count(old)
    if n == 0:
        raise ToolError(f"edit_file: 'old' text not found in {a['path']!r} (it must match exactly, "
                        "whitespace included)" + closest_text_hint(text, old))
    if n > 1:
        raise ToolError(f"edit_file: 'old' text occurs {n} times in {a['path']!r}; include more context "
                        "so it matches exactly once")
    _write_text(ctx, parts, text.replace(old, new, 1), create_dirs=False)
    line = text[:text.index(old)].count("\n") + 1
    return f"edited {a['path']} at line {line}: -{old.count(chr(10)) + 1} +{new.count(chr(10)) + 1} lines"


def _write_file(ctx: ToolContext, a: dict) -> str:
    content = a["content"]
    if len(content) > MAX_WRITE_CHARS:
        raise ToolError(f"write_file: content is {len(content)} chars; the limit is {MAX_WRITE_CHARS}")
    parts = split_rel(a["path"])
    if not parts:
        raise ToolError("write_file: path names the repository root")
    _write_text(ctx, parts, content, create_dirs=True)
    return f"wrote {a['path']} ({content.count(chr(10)) + (1 if content and not content.endswith(chr(10)) else 0)} lines)"


def _format_run(r, limit: int) -> str:
    head = f"exit code: {r.returncode}"
    if r.killed_reason:
        head += f" (killed: {r.killed_reason})"
    if r.truncated:
        head += " (output truncated)"
    out = head
    if r.stdout:
        out += "\n--- stdout ---\n" + r.stdout
    if r.stderr:
        out += "\n--- stderr ---\n" + r.stderr
    return truncate_middle(out, limit)


def _run(ctx: ToolContext, a: dict) -> str:
    cmd = a["command"]
    if not cmd.strip() or len(cmd) > 20_000:
        raise ToolError("run: command must be 1..20000 characters")
    timeout = a.get("timeout_s", ctx.run_timeout_s)
    if not 0 < timeout <= ctx.run_timeout_s:
        raise ToolError(f"run: timeout_s must be in (0, {ctx.run_timeout_s}]")
    r = ctx.sandbox.run(["bash", "-c", cmd], ctx.root, timeout_s=timeout)
    return _format_run(r, ctx.max_output_chars)


def _run_tests(ctx: ToolContext, a: dict) -> str:
    argv = list(ctx.test_command)
    if "path" in a:
        argv.append("/".join(split_rel(a["path"])) or ".")
    r = ctx.sandbox.run(argv, ctx.root, timeout_s=ctx.run_timeout_s)
    return _format_run(r, ctx.max_output_chars)


def _todo(ctx: ToolContext, a: dict) -> str:
    try:
        return ctx.todos.apply(a["action"], a.get("id"), a.get("text"))
    except TodoError as e:
        raise ToolError(str(e)) from None


ALL_TOOLS: dict[str, Tool] = {t.name: t for t in [
    Tool("read_file", "Read a text file, optionally a 1-based inclusive line range.",
         {"path": Param("string", True), "start_line": Param("integer"), "end_line": Param("integer")},
         _read_file),
    Tool("list_dir", "List a directory (recursive=true walks subdirectories).",
         {"path": Param("string"), "recursive": Param("boolean")}, _list_dir),
    Tool("grep", "Search files for an extended regular expression (grep -rnE).",
         {"pattern": Param("string", True), "path": Param("string"), "include": Param("string")}, _grep),
    Tool("edit_file", "Replace the exact text `old` (which must occur exactly once) with `new`.",
         {"path": Param("string", True), "old": Param("string", True), "new": Param("string", True)},
         _edit_file, mutating=True),
    Tool("write_file", "Create or overwrite a file with `content`.",
         {"path": Param("string", True), "content": Param("string", True)}, _write_file, mutating=True),
    Tool("run", "Run a bash command in the repository (sandboxed; no network).",
         {"command": Param("string", True), "timeout_s": Param("number")}, _run),
    Tool("run_tests", "Run the repository's tests (pytest), optionally for one path.",
         {"path": Param("string")}, _run_tests),
    Tool("todo", "Keep a to-do list: action add (text), update (id, text), complete (id), remove (id) or "
         "list. Returns the whole list; it is kept when the context is summarized, and items left open "
         "at the end count against the episode.",
         {"action": Param("string", True), "id": Param("integer"), "text": Param("string")}, _todo,
         mutating=True),
]}
DEFAULT_TOOLSET = tuple(ALL_TOOLS)


def make_toolset(names: list[str] | tuple[str, ...] | None) -> dict[str, Tool]:
    names = DEFAULT_TOOLSET if names is None else names
    unknown = [n for n in names if n not in ALL_TOOLS]
    if unknown:
        raise ValueError(f"unknown tool name(s) {unknown} in the task's tool set; known: {sorted(ALL_TOOLS)}")
    return {n: ALL_TOOLS[n] for n in names}


def execute_one(call: ToolCall, tools: dict[str, Tool], ctx: ToolContext) -> ToolResult:
    t0 = time.monotonic()
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call.index, call.name, False,
                          f"unknown tool {call.name!r}; available: {', '.join(tools)}", malformed=True)
    try:
        check_args(tool, call.arguments)
    except ToolError as e:
        return ToolResult(call.index, call.name, False, str(e), malformed=True)
    try:
        out = tool.handler(ctx, call.arguments)
        return ToolResult(call.index, call.name, True, truncate_middle(out, ctx.max_output_chars),
                          wall_s=time.monotonic() - t0)
    except ToolError as e:
        return ToolResult(call.index, call.name, False, truncate_middle(str(e), ctx.max_output_chars),
                          wall_s=time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - never let a tool bug end the episode
        return ToolResult(call.index, call.name, False, f"internal tool error: {type(e).__name__}: "
                          f"{str(e)[:500]}", internal_error=True, wall_s=time.monotonic() - t0)


def execute_calls(calls: list[ToolCall], errors: list[CallError], tools: dict[str, Tool],
                  ctx: ToolContext, executor: concurrent.futures.Executor | None = None) -> list[ToolResult]:
    """Runs one turn's calls together; results come back in call order."""
    results: dict[int, ToolResult] = {
        e.index: ToolResult(e.index, e.name, False, e.message, malformed=True) for e in errors}
    batch: list[ToolCall] = []

    def flush():
        if len(batch) == 1 or executor is None:
            for c in batch:
                results[c.index] = execute_one(c, tools, ctx)
        elif batch:
            futs = {c.index: executor.submit(execute_one, c, tools, ctx) for c in batch}
            for i, f in futs.items():
                results[i] = f.result()
        batch.clear()

    for c in sorted(calls, key=lambda c: c.index):
        tool = tools.get(c.name)
        if tool is not None and tool.mutating:
            flush()
            results[c.index] = execute_one(c, tools, ctx)
        else:
            batch.append(c)
    flush()
    return [results[i] for i in sorted(results)]
