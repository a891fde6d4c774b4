"""Self-summarization (report section 4) and the baselines it is compared with.

All methods are context hooks for the episode runner (EpisodeConfig.context_hook, fired before
a model turn once the current segment holds >= context_trigger_tokens tokens):

  "self"      the model's own summary. The fixed SUMMARIZE_QUERY is appended to the live
              context; the model may think, then writes <|summary|>...<|/summary|>; those tokens
              are model tokens of the current segment (trained with the chain's reward). The
              context then restarts as
                  system + task + <|summary|>summary<|/summary|> + carried state + <|assistant|>
              where the carried state is the number of summaries so far and, when this summary
              has no PLAN:/TODO: lines, the plan and remaining to-dos of the last one that had,
              and the `todo` tool's list (c2jax.agent.todos) when the model has used it.
              With a HarnessSampler the summary is decoded on top of the live KV cache (only the
              query is prefilled), and after the restart only what follows the shared
              system + task prefix is prefilled.
  "prompt"    prompt-based compaction: a *separate* call with its own prompt
              (COMPACTION_SYSTEM / COMPACTION_PROMPT) over the full transcript as text. It does
              not continue the model's cache (the whole transcript is prefilled again), and its
              tokens are not part of any training sequence. Same restart as "self".
  "truncate"  drop the oldest turns: restart from system + task (+ the `todo` list, when used),
              followed by the most recent whole turns that fit in `keep_tokens` (kept history is
              re-prefilled).
  "none"      full context: no hook.

Budgets: at most `max_summaries` compactions per episode (afterwards the context just grows
until EpisodeConfig.max_context_tokens ends the episode), `max_summary_tokens` per summary,
and EpisodeConfig.max_total_tokens over the whole chain.

Episode stats gain: summaries, summary_tokens (generated summary tokens incl. thinking),
summary_prefill_tokens (tokens prefilled for the summary calls, when the policy counts them),
truncations, dropped_tokens.

`PrefillMeter` wraps any policy and counts the tokens a prefix-caching sampler would prefill
(the same accounting as c2jax.sampling.HarnessSampler), so scripted policies report prefill
costs too.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from c2jax.agent import chat_format as cf
from c2jax.agent.chat_format import escape_free
from c2jax.agent.policy_protocol import COMPACTION_PROMPT, COMPACTION_SYSTEM, SUMMARIZE_QUERY, PolicyOutput

METHODS = ("self", "prompt", "truncate", "none")

RESTART_NOTE = "The conversation was summarized to free context; continue the task."


@dataclasses.dataclass
class SummaryConfig:
    method: str = "self"                 # self | prompt | truncate | none
    trigger_tokens: int = 2048           # summarize when the segment holds this many tokens
    max_summaries: int = 8               # compactions per episode (then the context just grows)
    max_summary_tokens: int = 512        # generated tokens per summary (thinking included)
    keep_tokens: int | None = None       # truncate: history kept after the prefix (None: trigger // 2)
    max_transcript_chars: int = 200_000  # prompt: transcript given to the compaction call
    query: str = SUMMARIZE_QUERY         # self: the fixed summarize query

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"SummaryConfig.method must be one of {METHODS}, got {self.method!r}")
        for name in ("trigger_tokens", "max_summary_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SummaryConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_summaries < 0:
            raise ValueError(f"SummaryConfig.max_summaries must be >= 0, got {self.max_summaries}")


@dataclasses.dataclass
class CarriedState:
    """What survives a restart besides the summary itself."""

    plan: str = ""
    todos: list[str] = dataclasses.field(default_factory=list)
    num_summaries: int = 0

    def render(self, max_summaries: int | None = None, summary: str = "") -> str:
        """The restart note; the plan and to-dos only where `summary` does not already state them
        (they were carried from an earlier summary): repeating them would spend context for nothing."""
        of = f" of at most {max_summaries}" if max_summaries else ""
        lines = [f"{RESTART_NOTE} Summaries so far: {self.num_summaries}{of}."]
        stated_plan, stated_todos = parse_plan_todos(summary)
        if self.plan and self.plan != stated_plan:
            lines.append(f"Plan: {self.plan}")
        if self.todos and self.todos != stated_todos:
            lines.append("Remaining to-dos:\n" + "\n".join(f"- {t}" for t in self.todos))
        return "\n".join(lines)


def parse_plan_todos(summary: str) -> tuple[str, list[str]]:
    """PLAN: line and TODO: lines of a summary ("" / [] when absent)."""
    plan, todos = "", []
    for line in summary.splitlines():
        s = line.strip().lstrip("-* ").strip()
        u = s.upper()
        if u.startswith("PLAN:"):
            plan = s[5:].strip()
        elif u.startswith("TODO:"):
            t = s[5:].strip()
            if t:
                todos.append(t)
    return plan, todos


def extract_summary(text: str) -> tuple[str, str]:
    """(summary, thinking) of a summary message; without markers the visible text is used."""
    p = cf.parse_assistant(text, max_calls=64)
    summary = p.summary if p.summary is not None else p.content
    return summary.strip(), p.thinking


def todo_note(state) -> str:
    """The `todo` tool's list as restated after a restart ("" when the model never used it)."""
    todos = getattr(state, "todos", None)
    text = todos.render() if todos is not None else ""
    return f"Your {text}" if text else ""


def restart_prefix(state, summary: str, carried: CarriedState, max_summaries: int | None) -> str:
    """system + task + summary + carried state (+ the to-do list) + assistant prefix, as environment text."""
    note = "\n".join(x for x in (carried.render(max_summaries, summary), todo_note(state)) if x)
    return (cf.render_system(state.system_text) + cf.render_user(state.task.prompt)
            + cf.render_summary(summary) + cf.render_user(note) + cf.assistant_prefix())


def _policy_prefill(policy) -> int | None:
    """Tokens prefilled so far by the policy's sampler/meter (None when it does not count)."""
    for obj in (policy, getattr(policy, "sampler", None)):
        v = getattr(obj, "prefill_tokens", None) if obj is not None else None
        if isinstance(v, int):
            return v
    return None


def _stats(state) -> dict:
    s = state.stats
    for k in ("summaries", "summary_tokens", "summary_thinking_tokens", "summary_prefill_tokens",
              "truncations", "dropped_tokens", "compaction_calls"):
        s.setdefault(k, 0)
    return s


class ContextHook:
    """The runner hook for one method (stateless: per-episode data lives on the EpisodeState,
    so one hook can serve concurrent episodes)."""

    def __init__(self, cfg: SummaryConfig, compaction_policy=None):
        self.cfg = cfg
        self.compaction_policy = compaction_policy   # prompt method; None: the episode's policy

    def carried(self, state) -> CarriedState:
        return state.extra.setdefault("carried", CarriedState())

    def __call__(self, state) -> None:
        stats = _stats(state)
        cfg = self.cfg
        done = stats["summaries"] + stats["truncations"]
        if cfg.method == "none" or done >= cfg.max_summaries:
            return
        if cfg.method == "self":
            self._self(state, stats)
        elif cfg.method == "prompt":
            self._prompt(state, stats)
        elif cfg.method == "truncate":
            self._truncate(state, stats)

    # -- the model's own summary, decoded on the live context
    def _self(self, state, stats):
        query = state.codec.encode(cf.render_user(self.cfg.query) + cf.assistant_prefix())
        if state.budget() < len(query) + 8:
            return
        state.append_env_tokens(query)
        p0 = _policy_prefill(state.policy)
        ids = state.generate(self.cfg.max_summary_tokens)
        p1 = _policy_prefill(state.policy)
        if p0 is not None and p1 is not None:
            stats["summary_prefill_tokens"] += p1 - p0
        summary, thinking = extract_summary(state.codec.decode(ids))
        stats["summary_tokens"] += len(ids)
        stats["summary_thinking_tokens"] += len(state.codec.encode(thinking)) if thinking else 0
        self._restart_with(state, stats, summary)

    # -- a separate compaction call over the transcript (no cache reuse, not trained)
    def _prompt(self, state, stats):
        codec = state.codec
        transcript = codec.decode(state.tokens)[-self.cfg.max_transcript_chars:]
        ctx = compaction_context(codec, transcript, state.config.max_context_tokens, self.cfg.max_summary_tokens)
        policy = self.compaction_policy or state.policy
        p0 = _policy_prefill(policy)
        out: PolicyOutput = policy.act(ctx, self.cfg.max_summary_tokens, codec)
        p1 = _policy_prefill(policy)
        stats["summary_prefill_tokens"] += (p1 - p0) if (p0 is not None and p1 is not None) else len(ctx)
        ids = codec.cut_at_stop(out.token_ids, self.cfg.max_summary_tokens)
        stats["compaction_calls"] += 1
        stats["summary_tokens"] += len(ids)
        state.total_tokens += len(ids)   # the compaction's output counts against the chain's budget
        summary, thinking = extract_summary(codec.decode(ids))
        stats["summary_thinking_tokens"] += len(codec.encode(thinking)) if thinking else 0
        self._restart_with(state, stats, summary)

    def _restart_with(self, state, stats, summary: str):
        c = self.carried(state)
        plan, todos = parse_plan_todos(summary)
        c.plan = plan or c.plan
        c.todos = todos if (plan or todos) else c.todos
        c.num_summaries += 1
        stats["summaries"] += 1
        state.restart(restart_prefix(state, summary, c, self.cfg.max_summaries), reason="summarized")

    # -- plain truncation of the oldest turns
    def _truncate(self, state, stats):
        keep = self.cfg.keep_tokens or self.cfg.trigger_tokens // 2
        n = len(state.tokens)
        # chunk starts; a kept history must begin at a model message (right after <|assistant|>)
        starts, pos = [], 0
        for ln in state.chunk_lens:
            starts.append(pos)
            pos += ln
        cut = None
        for s, ln in zip(starts, state.chunk_lens):
            if ln and state.mask[s] and n - s <= keep and s > 0:
                cut = s
                break
        carry = state.tokens[cut:] if cut is not None else []
        todo = todo_note(state)
        prefix = (cf.render_system(state.system_text) + cf.render_user(state.task.prompt)
                  + (cf.render_user(todo) if todo else "") + cf.assistant_prefix())
        dropped = n - len(carry)
        stats["truncations"] += 1
        stats["dropped_tokens"] += dropped
        state.restart(prefix, reason="truncated", carry_ids=list(carry))


def compaction_context(codec, transcript: str, window: int | None = None, room: int = 0) -> list[int]:
    """Token ids of the compaction call; with a context `window`, the transcript's oldest text
    is dropped until the call plus `room` generated tokens fits in it."""
    def build(t):
        return codec.encode(cf.render_system(COMPACTION_SYSTEM) + cf.render_user(COMPACTION_PROMPT + t)
                            + cf.assistant_prefix())
    ctx = build(transcript)
    while window and len(ctx) + room > window and transcript:
        excess = len(ctx) + room - window   # a token covers >= 1 character: drop at least that many
        transcript = transcript[excess:]
        ctx = build(transcript)
    if window and len(ctx) + room > window:
        raise ValueError(f"the compaction prompt alone ({len(ctx)} tokens) + {room} summary tokens does not fit "
                         f"the context window of {window}")
    return ctx


def summary_episode_config(base, cfg: SummaryConfig, compaction_policy=None):
    """`base` (an EpisodeConfig) with the hook and trigger of `cfg` (method "none": no hook)."""
    if cfg.method == "none":
        return dataclasses.replace(base, context_trigger_tokens=None, context_hook=None)
    return dataclasses.replace(base, context_trigger_tokens=cfg.trigger_tokens,
                               context_hook=ContextHook(cfg, compaction_policy))


# ----------------------------------------------------------------------------- SFT transcripts
def write_chain_transcripts(tasks, policy_factory, tokenizer, out_path: str, config, sandbox=None,
                            concurrency: int = 2) -> dict:
    """Run `policy_factory(task)` on every task with `config` (an EpisodeConfig, usually from
    summary_episode_config) and write the passing episodes as SFT data: one JSONL record per
    segment {"tokens", "loss_mask", "task_id", "chain_index", "chain_length"}, the harness token
    format of c2jax.pipeline.write_oracle_transcripts (summaries are model tokens)."""
    import os

    from c2jax.agent.runner import run_episodes
    from c2jax.data.pipeline import token_record
    results = run_episodes(list(tasks), policy_factory, tokenizer, sandbox, config, concurrency=concurrency)
    out = {"tasks": len(results), "kept": 0, "failed": 0, "segments": 0, "summaries": 0, "max_segment_tokens": 0}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        for r in results:
            if not (r.grade and r.grade.passed):
                out["failed"] += 1
                continue
            out["kept"] += 1
            out["summaries"] += int(r.stats.get("summaries", 0))
            for k, seg in enumerate(r.segments):
                f.write(token_record(seg.tokens_T, seg.loss_mask_T, task_id=seg.task_id, chain_index=k,
                                     chain_length=len(r.segments)))
                out["segments"] += 1
                out["max_segment_tokens"] = max(out["max_segment_tokens"], len(seg.tokens_T))
    return out


# ----------------------------------------------------------------------------- prefill meter
def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefillMeter:
    """Wraps a policy; counts the tokens a prefix-caching sampler with `slots` cache slots
    would prefill (HarnessSampler's accounting: reuse the idle slot sharing the longest
    prefix, prefill the rest; a finished call leaves context + output cached in its slot)."""

    def __init__(self, policy, slots: int = 2):
        self.policy = policy
        self.slots: list[list[int]] = [[] for _ in range(max(1, slots))]
        self.used = [0] * len(self.slots)
        self.tick = 0
        self.prefill_tokens = 0
        self.calls = 0

    @property
    def version(self) -> int:
        return int(getattr(self.policy, "version", 0))

    def __getattr__(self, name: str) -> Any:  # forward anything else (e.g. .task of a scripted policy)
        if name == "policy":
            raise AttributeError(name)
        return getattr(self.policy, name)

    def act(self, context, max_new_tokens, codec) -> PolicyOutput:
        ctx = [int(t) for t in context]
        best, src = 0, None
        for s, toks in enumerate(self.slots):
            lcp = _lcp(toks, ctx)
            if lcp > best:
                best, src = lcp, s
        start = min(best, len(ctx) - 1) if ctx else 0
        self.prefill_tokens += len(ctx) - start
        self.calls += 1
        if src is None:
            src = min(range(len(self.slots)), key=lambda s: self.used[s])
        out = self.policy.act(context, max_new_tokens, codec)
        self.tick += 1
        self.used[src] = self.tick
        self.slots[src] = ctx + [int(i) for i in out.token_ids][:max_new_tokens]
        return out


__all__ = ["METHODS", "SUMMARIZE_QUERY", "COMPACTION_SYSTEM", "COMPACTION_PROMPT", "SummaryConfig",
           "compaction_context", "write_chain_transcripts",
           "CarriedState", "ContextHook", "PrefillMeter", "summary_episode_config", "parse_plan_todos",
           "extract_summary", "restart_prefix", "todo_note", "escape_free"]
