"""The episode runner: drives a policy through turns and records a Trajectory.

The context is one append-only token list: environment segments are rendered and encoded
once, model tokens are appended exactly as sampled, and history is never re-rendered, so the
Trajectory's tokens are exactly what the model saw. Model errors (malformed calls, tool
failures, parser surprises) become error tool results and counted stats; only a failing
policy/sampler ends the episode early (finish_reason "policy_error"). A turn cut at its token
limit is counted (stats["truncated_turns"]) and the tool call it cut off comes back as an
explicit truncation result, so the model learns to split large edits. A grader that raises
is counted too (stats["grader_exceptions"], with its type in stats["grader_exception_type"]).
The `todo` tool's list (c2jax.agent.todos) lives on the EpisodeState for the whole episode; at the
end stats hold todos_created, todos_completed and unfinished_todos (items still open).

Self-summarization hook: set EpisodeConfig.context_trigger_tokens and context_hook. Before a
model turn, when the current segment holds >= trigger tokens, context_hook(state) is called;
it may use state.append_env(), state.generate() and state.restart(prefix_text) (which closes
the current segment as a Trajectory and starts a new one). EpisodeResult.segments holds all
segments in order; EpisodeResult.trajectory is the last one. c2jax.agent.summarize provides
the hooks (self-summarization, prompt-based compaction, truncation). With
EpisodeConfig.max_context_tokens set, a segment that reaches it ends the episode
("context_full"), as a model with that context window would.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from c2jax import special_tokens as st
from c2jax.agent import chat_format as cf
from c2jax.agent import tools as tl
from c2jax.agent.policy import Policy, PolicyOutput
from c2jax.agent.task_protocol import task_attr
from c2jax.agent.todos import TodoList
from c2jax.agent.workspace import Workspace, count_changed_lines
from c2jax.trajectory import Trajectory

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent working in a repository mounted at /task. Use the tools to "
    "inspect and change it. Call tools by writing "
    f'{st.TOOL_CALL}{{"name": TOOL, "arguments": {{...}}}}{st.END_TOOL_CALL}; several calls in one '
    "message run in parallel. When the work is done, reply with a short final message and no "
    "tool calls.")


@dataclasses.dataclass
class EpisodeConfig:
    max_turns: int = 32                 # assistant messages per episode
    max_total_tokens: int = 262_144     # all tokens over all segments (context budget)
    max_new_tokens: int = 32_768        # per assistant message (a 16 KB write_file fits, even byte-level)
    max_tool_output_chars: int = 8000   # per tool result
    max_calls_per_turn: int = 16        # more are errors
    max_call_chars: int = 64_000        # one tool call's JSON
    run_timeout_s: float = 30.0         # cap for run / run_tests
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    list_tools_in_system: bool = True   # append the tool specs (JSON) to the system prompt
    grade: bool = True                  # call task.grade after the episode
    keep_workspace: bool = False        # leave the workspace on disk (EpisodeResult.workspace)
    context_trigger_tokens: int | None = None   # self-summarization trigger (segment length)
    context_hook: Callable[[EpisodeState], None] | None = None
    max_context_tokens: int | None = None       # context window of one segment (None: unbounded)

    def __post_init__(self):
        for name in ("max_turns", "max_total_tokens", "max_new_tokens", "max_tool_output_chars",
                     "max_calls_per_turn", "max_call_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EpisodeConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_context_tokens is not None and self.max_context_tokens <= 0:
            raise ValueError(f"EpisodeConfig.max_context_tokens must be > 0 or None, got {self.max_context_tokens}")

    @property
    def context_tokens(self) -> int:
        """Tokens one generation's context may hold: the segment window, else the episode budget."""
        return int(self.max_context_tokens or self.max_total_tokens)


@dataclasses.dataclass
class EpisodeGrade:
    passed: bool
    score: float
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class EpisodeResult:
    trajectory: Trajectory
    grade: Any                          # the task's Grade (passed, score, details) or None
    stats: dict
    segments: list[Trajectory] = dataclasses.field(default_factory=list)
    diff: str = ""
    final_message: str = ""
    workspace: Workspace | None = None  # only with keep_workspace
    tool_calls: list[dict] = dataclasses.field(default_factory=list)  # [{"name", "arguments"}] in call order


class EpisodeState:
    """The growing token context of one segment plus episode-wide counters."""

    def __init__(self, task, policy: Policy, codec: cf.TokenCodec, config: EpisodeConfig, stats: dict):
        self.task, self.policy, self.codec, self.config, self.stats = task, policy, codec, config, stats
        self.segments: list[Trajectory] = []
        self.total_tokens = 0
        self.system_text = ""    # set by run_episode: the rendered system prompt's text
        self.extra: dict = {}    # per-episode scratch space for context hooks
        self.last_limit = 0      # the token limit of the last generate() call
        self.todos = TodoList()  # the `todo` tool's list; survives restarts (summaries, truncation)
        self._new_segment()

    def _new_segment(self):
        self.tokens: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.experts: list[np.ndarray | None] = []   # per appended chunk; None for env chunks
        self.chunk_lens: list[int] = []

    def append_env(self, text: str) -> int:
        return self.append_env_tokens(self.codec.encode(text))

    def append_env_tokens(self, ids) -> int:
        """Appends already-encoded environment tokens (e.g. kept history after a truncation)."""
        ids = [int(i) for i in ids]
        self.tokens += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.experts.append(None)
        self.chunk_lens.append(len(ids))
        self.total_tokens += len(ids)
        self.stats["env_tokens"] += len(ids)
        return len(ids)

    def budget(self) -> int:
        b = self.config.max_total_tokens - self.total_tokens
        if self.config.max_context_tokens:
            b = min(b, self.config.max_context_tokens - len(self.tokens))
        return b

    def generate(self, max_new_tokens: int | None = None) -> list[int]:
        """One policy call on the current context; appends and returns the model tokens."""
        n = min(max_new_tokens or self.config.max_new_tokens, max(self.budget(), 0))
        self.last_limit = n
        t0 = time.monotonic()
        out: PolicyOutput = self.policy.act(list(self.tokens), n, self.codec)
        self.stats["model_s"] += time.monotonic() - t0
        ids = self.codec.cut_at_stop(out.token_ids, n)
        m = len(ids)
        lp = list(out.logprobs)[:m] if out.logprobs is not None else [0.0] * m
        if len(lp) != m:
            raise ValueError(f"policy returned {len(lp)} logprobs for {m} tokens")
        v = out.versions
        if v is None:
            v = [int(getattr(self.policy, "version", 0))] * m
        elif isinstance(v, (int, np.integer)):
            v = [int(v)] * m
        else:
            v = [int(x) for x in list(v)[:m]]
        ex = None
        if out.expert_ids is not None:
            ex = np.asarray(out.expert_ids, np.int32)[:m]
        self.tokens += ids
        self.mask += [True] * m
        self.logprobs += lp
        self.versions += v
        self.experts.append(ex)
        self.chunk_lens.append(m)
        self.total_tokens += m
        self.stats["completion_tokens"] += m
        return ids

    def restart(self, prefix_text: str, reason: str = "summarized", carry_ids=None) -> None:
        """Closes the current segment (finish_reason `reason`) and starts a new one from
        `prefix_text` (env tokens), followed by `carry_ids` (token ids, env) if given."""
        self.segments.append(self.to_trajectory(reason))
        self.stats["segments"] = len(self.segments) + 1
        self._new_segment()
        self.append_env(prefix_text)
        if carry_ids is not None and len(carry_ids):
            self.append_env_tokens(carry_ids)

    def to_trajectory(self, finish_reason: str) -> Trajectory:
        experts = None
        shapes = [e.shape[1:] for e in self.experts if e is not None and e.ndim == 3]
        if shapes:
            nk = shapes[0]
            rows = []
            for e, n in zip(self.experts, self.chunk_lens):
                if e is not None and e.ndim == 3 and e.shape[1:] == nk and e.shape[0] == n:
                    rows.append(e)
                else:  # env tokens (or a chunk without experts): -1 = no replay, router decides
                    rows.append(np.full((n, *nk), -1, np.int32))
            experts = np.concatenate(rows, 0) if rows else None
        return Trajectory(
            tokens_T=np.asarray(self.tokens, np.int32),
            loss_mask_T=np.asarray(self.mask, bool),
            logprobs_T=np.asarray(self.logprobs, np.float32),
            versions_T=np.asarray(self.versions, np.int32),
            expert_ids_TNK=experts,
            task_id=str(self.task.task_id),
            finish_reason=finish_reason,
            stats=dict(self.stats))


def _new_stats() -> dict:
    return {"turns": 0, "tool_calls": 0, "tool_calls_by_name": collections.Counter(),
            "malformed_calls": 0, "tool_errors": 0, "internal_tool_errors": 0,
            "parallel_calls_per_turn": [], "completion_tokens": 0, "env_tokens": 0,
            "thinking_tokens": 0, "tool_call_tokens": 0, "tool_output_tokens": 0,
            "final_message_tokens": 0, "model_s": 0.0, "tool_s": 0.0, "grade_s": 0.0, "wall_s": 0.0,
            "interrupted": False, "segments": 1, "finish_reason": "", "error": "",
            "truncated_turns": 0, "truncated_calls": 0, "grader_exceptions": 0, "grader_exception_type": "",
            "harness_exceptions": 0, "harness_exception_type": "",
            "todos_created": 0, "todos_completed": 0, "unfinished_todos": 0}


def system_text(task, config: EpisodeConfig, tools: dict[str, tl.Tool]) -> str:
    parts = [config.system_prompt]
    rules = task_attr(task, "system_rules")
    if rules:
        parts.append(rules)
    if config.list_tools_in_system:
        parts.append("Tools:\n" + "\n".join(json.dumps(t.spec()) for t in tools.values()))
    return "\n\n".join(parts)


_SHARED_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXEC_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _SHARED_EXECUTOR
    with _EXEC_LOCK:
        if _SHARED_EXECUTOR is None:
            _SHARED_EXECUTOR = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="c2jax-tool")
        return _SHARED_EXECUTOR


def run_episode(task, policy: Policy, tokenizer=None, sandbox=None, config: EpisodeConfig | None = None,
                group_id: str = "") -> EpisodeResult:
    """Runs one episode of `policy` on `task` in a fresh workspace; grades it (config.grade)."""
    config = config or EpisodeConfig()
    codec = cf.as_codec(tokenizer)
    if sandbox is None:
        from c2jax.agent.sandbox import Sandbox
        sandbox = Sandbox()
    tools = tl.make_toolset(task_attr(task, "tools"))
    t_start = time.monotonic()
    stats = _new_stats()
    ws = Workspace.create(task, sandbox=sandbox)
    ctx = tl.ToolContext(root=ws.path, sandbox=sandbox, uid=ws.uid,
                         max_output_chars=config.max_tool_output_chars, run_timeout_s=config.run_timeout_s)
    visible = task_attr(task, "visible_test_command") or (task_attr(task, "metadata") or {}).get(
        "visible_test_command")
    if visible:  # run_tests runs the task's own visible test command instead of pytest
        ctx.test_command = tuple(visible)
    state = EpisodeState(task, policy, codec, config, stats)
    ctx.todos = state.todos
    all_calls: list[dict] = []
    final_message = ""
    finish = ""
    interruption = task_attr(task, "interruption")
    state.system_text = system_text(task, config, tools)
    try:
        state.append_env(cf.render_system(state.system_text) + cf.render_user(task.prompt)
                         + cf.assistant_prefix())
        while True:
            if stats["turns"] >= config.max_turns:
                finish = "max_turns"
                break
            if (config.context_hook is not None and config.context_trigger_tokens
                    and len(state.tokens) >= config.context_trigger_tokens):
                config.context_hook(state)
            if config.max_context_tokens and len(state.tokens) >= config.max_context_tokens:
                finish = "context_full"
                break
            if state.budget() <= 0:
                finish = "max_tokens"
                break
            try:
                ids = state.generate()
            except Exception as e:  # noqa: BLE001 - a broken sampler ends this episode only
                finish = "policy_error"
                stats["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
                break
            stats["turns"] += 1
            try:
                text = codec.decode(ids)
                parsed = cf.parse_assistant(text, max_calls=config.max_calls_per_turn,
                                            max_call_chars=config.max_call_chars)
            except Exception as e:  # noqa: BLE001 - the parser must never end an episode
                parsed = cf.ParsedMessage("", "", [], [cf.CallError(0, "", f"could not parse the message: "
                                                                    f"{type(e).__name__}", "")], False)
            _count_message_tokens(codec, parsed, stats)
            if not parsed.ended and len(ids) >= state.last_limit:
                stats["truncated_turns"] += 1
                stats["truncated_calls"] += _mark_truncated(parsed, state.last_limit)
            if not parsed.ended:
                state.append_env(st.END_TURN)
            interrupt_now = bool(interruption) and stats["turns"] == int(interruption[0])
            if parsed.is_final and not interrupt_now:
                final_message = parsed.content
                stats["final_message_tokens"] = len(codec.encode(parsed.content)) if parsed.content else 0
                finish = "final" if parsed.ended else "max_new_tokens"
                break
            # each tool result is encoded once; it starts and ends in special tokens, so encoding
            # the results apart gives the same ids as encoding their concatenation
            env_ids: list[int] = []
            if not parsed.is_final:
                t0 = time.monotonic()
                results = tl.execute_calls(parsed.calls, parsed.errors, tools, ctx, _executor())
                stats["tool_s"] += time.monotonic() - t0
                stats["parallel_calls_per_turn"].append(len(results))
                for r in results:
                    stats["tool_calls"] += 1
                    stats["tool_calls_by_name"][r.name or "?"] += 1
                    stats["malformed_calls"] += int(r.malformed)
                    stats["internal_tool_errors"] += int(r.internal_error)
                    stats["tool_errors"] += int(not r.ok and not r.malformed)
                    out = tl.truncate_middle(r.output, config.max_tool_output_chars)
                    seg_ids = codec.encode(cf.render_tool_result(r.index, r.name, r.ok, out))
                    stats["tool_output_tokens"] += len(seg_ids)
                    env_ids += seg_ids
                for c in parsed.calls:
                    all_calls.append({"name": c.name, "arguments": c.arguments})
            tail = cf.assistant_prefix()
            if interrupt_now:
                stats["interrupted"] = True
                tail = cf.render_user(interruption[1]) + tail
            state.append_env_tokens(env_ids + codec.encode(tail))
    except Exception as e:  # noqa: BLE001 - harness bug: record it, still return a trajectory
        finish = "harness_error"
        stats["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        stats["harness_exceptions"] += 1
        stats["harness_exception_type"] = type(e).__name__
    stats["finish_reason"] = finish
    stats["final_message"] = final_message
    stats["todos_created"] = state.todos.created
    stats["todos_completed"] = state.todos.completed
    stats["unfinished_todos"] = state.todos.unfinished()
    grade = None
    diff = ""
    try:
        diff = ws.diff()
        stats["lines_changed"] = count_changed_lines(diff)
        if config.grade:
            t0 = time.monotonic()
            episode = {"final_message": final_message, "tool_calls": all_calls,
                       "original_files": dict(task.files)}
            try:
                grade = task.grade(ws.path, sandbox.run, episode)
            except Exception as e:  # noqa: BLE001 - reward 0, but counted: a broken grader must show
                grade = EpisodeGrade(False, 0.0, {"error": f"grader raised {type(e).__name__}: {e}",
                                                  "grader_exception": type(e).__name__})
                stats["grader_exceptions"] += 1
                stats["grader_exception_type"] = type(e).__name__
            stats["grade_s"] = time.monotonic() - t0
    finally:
        if not config.keep_workspace:
            ws.cleanup()
    stats["wall_s"] = time.monotonic() - t_start
    stats["tool_calls_by_name"] = dict(stats["tool_calls_by_name"])
    stats["max_parallel_calls"] = max(stats["parallel_calls_per_turn"], default=0)
    traj = state.to_trajectory(finish)
    traj.stats = dict(stats)
    traj.group_id = group_id
    if grade is not None:
        traj.reward_terms["verifier"] = float(getattr(grade, "score", 0.0))
    for s in state.segments:
        s.group_id = group_id
    return EpisodeResult(trajectory=traj, grade=grade, stats=stats, segments=state.segments + [traj],
                         diff=diff, final_message=final_message,
                         workspace=ws if config.keep_workspace else None, tool_calls=all_calls)


TRUNCATED_CALL = ("your message reached the limit of {n} tokens per turn and was cut off here; this "
                  "tool call was not run. Make large changes in smaller calls (e.g. write a file in "
                  "parts with edit_file).")


def _mark_truncated(parsed: cf.ParsedMessage, limit: int) -> int:
    """Turns the call a token limit cut off into an explicit truncation error; returns 0 or 1."""
    for e in parsed.errors:
        if e.message.startswith("unterminated tool call"):
            e.message = TRUNCATED_CALL.format(n=limit)
            return 1
    return 0


def exception_metrics(stats: list[dict], flat: bool = False) -> dict:
    """Grader / harness exceptions and truncated turns over episodes, with the exception types:
    `{kind}_exception_types` {type: n}, or with flat=True (scalar metrics) `{kind}_exceptions/{type}`."""
    out: dict = {}
    for kind in ("grader", "harness"):
        types: dict[str, int] = {}
        for one in stats:
            if one.get(f"{kind}_exceptions", 0):
                name = one.get(f"{kind}_exception_type") or "?"
                types[name] = types.get(name, 0) + int(one[f"{kind}_exceptions"])
        out[f"{kind}_exceptions"] = sum(types.values())
        if flat:
            out.update({f"{kind}_exceptions/{k}": v for k, v in sorted(types.items())})
        else:
            out[f"{kind}_exception_types"] = dict(sorted(types.items()))
    out["truncated_turns"] = int(sum(one.get("truncated_turns", 0) for one in stats))
    return out


def _count_message_tokens(codec: cf.TokenCodec, parsed: cf.ParsedMessage, stats: dict) -> None:
    """Approximate per-kind token counts (re-encoded text) for length penalties."""
    if parsed.thinking:
        stats["thinking_tokens"] += len(codec.encode(parsed.thinking))
    for c in parsed.calls:
        stats["tool_call_tokens"] += len(codec.encode(json.dumps({"name": c.name, "arguments": c.arguments})))
    for e in parsed.errors:
        stats["tool_call_tokens"] += len(codec.encode(e.raw))


def run_episodes(tasks: list, policy_factory: Callable[[Any], Policy], tokenizer=None, sandbox=None,
                 config: EpisodeConfig | None = None, concurrency: int = 8,
                 on_result: Callable[[int, EpisodeResult], None] | None = None) -> list[EpisodeResult]:
    """Runs one episode per task on `concurrency` threads; results in task order.

    Sandbox subprocess waits (and a sampler that releases the GIL) overlap across threads.
    """
    if sandbox is None:
        from c2jax.agent.sandbox import Sandbox
        sandbox = Sandbox()
    codec = cf.as_codec(tokenizer)
    results: list[EpisodeResult | None] = [None] * len(tasks)

    def one(i: int, policy):
        r = run_episode(tasks[i], policy, codec, sandbox, config)
        results[i] = r
        if on_result is not None:
            on_result(i, r)

    # Policies are made here, in task order, whatever the thread count: a factory that numbers the
    # attempts of a task (c2jax.pipeline.batched_policy_factory) gives each job the same number on
    # every run.
    if concurrency <= 1:
        for i in range(len(tasks)):
            one(i, policy_factory(tasks[i]))
    else:
        with concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="c2jax-episode") as ex:
            for f in [ex.submit(one, i, policy_factory(tasks[i])) for i in range(len(tasks))]:
                f.result()
    return results  # type: ignore[return-value]
