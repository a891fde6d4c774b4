"""Episode rewards: verifier score + behaviour terms - concave length penalty.

Composer 2 (report section 3): the reward is the verifier's score on the final environment
state, plus behaviour terms (penalties for malformed tool calls, unfinished to-dos, ...), minus
a concave length penalty C(x) of an "effort" x, a weighted sum of how much the episode thought,
called tools, read tool output, wrote, and how many calls and turns it took. Penalizing turns
more than calls is what teaches parallel tool calls (many calls in one turn).

    C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q))      (q = 1: log(1 + k x) / k)

C(0) = 0, C'(0) = 1, C is increasing, and concave for q > 0 (q = 0 is linear: C(x) = x).

Episode stats the harness supplies (a dict; numbers, bools count as 0/1):
  effort (all default weights are nonzero, so these keys are required):
    "thinking_tokens"       tokens inside thinking blocks
    "tool_call_tokens"      tokens of tool-call arguments the model wrote
    "tool_output_tokens"    tokens of tool results the environment returned
    "final_message_tokens"  tokens of the final user-facing message
    "tool_calls"            number of tool calls
    "turns"                 number of model turns (one turn may hold several parallel calls)
  behaviour:
    "malformed_calls"          tool calls that failed to parse / validate
    "unfinished_todos"         items of the `todo` tool's list still open at the end of the episode
    "comment_reasoning_lines"  lines of reasoning dumped into code comments
    "terminal_only"            1 if every tool call went through the shell (no read/edit tools)
  behaviour from the end state and tool calls (`behaviour_stats`: the graders of
  c2jax.tasks.behaviour, each 1 - the grader's score in [0, 1]):
    "eager_edits"              a question-only task whose files were edited (or an edit tool called)
    "protected_paths"          a protected path (tests) was changed
    "debug_prints"             debug prints / breakpoints added to Python code
    "new_lint"                 ruff findings added to touched files (n findings: n / (1 + n))
    "missing_final_message"    the episode ended without a final message to the user
A key whose weight is nonzero must be present; set its weight to 0 to switch a term off.
Extra behaviour terms are added by adding a weight under `behaviour_weights` with the same name
as the stats key.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

EFFORT_KEYS = ("thinking_tokens", "tool_call_tokens", "tool_output_tokens",
               "final_message_tokens", "tool_calls", "turns")
BEHAVIOUR_KEYS = ("malformed_calls", "unfinished_todos", "comment_reasoning_lines", "terminal_only")
GRADED_KEYS = ("eager_edits", "protected_paths", "debug_prints", "new_lint", "missing_final_message")
DEFAULT_PROTECTED = ("tests/*", "test_*.py", "*/tests/*")


def length_penalty(x, k: float, q: float):
    """C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)), elementwise, jit-able (q may be traced).

    Written as expm1((1 - q) log1p(k x)) / (k (1 - q)), which is exact at q = 1 (log1p(k x) / k
    by the series branch) and stays accurate for q near 1. Requires k > 0 and x >= 0.
    """
    x = jnp.asarray(x, dtype=jnp.result_type(float, x))
    a = 1.0 - jnp.asarray(q, x.dtype)
    ell = jnp.log1p(k * x)
    small = jnp.abs(a) < 1e-6
    a_safe = jnp.where(small, 1.0, a)
    general = jnp.expm1(a_safe * ell) / (k * a_safe)
    series = ell / k * (1.0 + 0.5 * a * ell)  # expm1(a l)/(a k) to first order in a
    return jnp.where(small, series, general)


def effort(stats: Mapping[str, Any], weights: Mapping[str, float]) -> float:
    """x = sum_i w_i * stats[i] over the effort weights."""
    return float(sum(float(w) * _stat(stats, key, w) for key, w in weights.items()))


def _stat(stats: Mapping[str, Any], key: str, weight: float) -> float:
    if key in stats:
        return float(stats[key])
    if float(weight) == 0.0:
        return 0.0
    raise KeyError(
        f"episode stats lack {key!r} (weight {weight}); the harness must report it, or set its "
        f"weight to 0 in the RL reward config. Stats keys present: {sorted(stats)}")


def compute_reward(verifier_score: float, stats: Mapping[str, Any], cfg) -> tuple[float, dict[str, float]]:
    """Total reward of one episode and every term separately (for logging).

    Args:
      verifier_score: score of the final environment state (e.g. fraction of tests passing).
      stats: episode stats from the harness (keys in the module docstring).
      cfg: the RL config block (`default_rl_loss_config()`): uses length_k, length_q,
        length_coef, effort_weights, behaviour_weights.
    Returns:
      (total, terms) where terms = {"verifier", "behaviour/<key>" (negative penalties),
      "effort_x" (not added), "length_penalty" (= -length_coef * C(x)), "total"}.
    """
    terms: dict[str, float] = {"verifier": float(verifier_score)}
    total = float(verifier_score)
    for key, w in cfg.behaviour_weights.items():
        term = -float(w) * _stat(stats, key, w)
        terms[f"behaviour/{key}"] = term
        total += term
    x = effort(stats, cfg.effort_weights)
    terms["effort_x"] = x
    c = float(length_penalty(x, cfg.length_k, cfg.length_q)) if x > 0 else 0.0
    terms["length_penalty"] = -float(cfg.length_coef) * c
    total += terms["length_penalty"]
    if not math.isfinite(total):
        raise ValueError(f"reward is not finite: terms={terms}")
    terms["total"] = total
    return total, terms


def behaviour_stats(original_files: Mapping[str, str] | None, final_files: Mapping[str, str] | None,
                    final_message: str = "", tool_calls: list[dict] | None = None, task=None) -> dict[str, float]:
    """The GRADED_KEYS stats of one episode (penalty sizes, 0 = clean) from the behaviour graders
    (c2jax.tasks.behaviour.behaviour_reward_terms), plus "comment_reasoning_lines". A task whose
    metadata["behaviour"] says category "question" (or metadata["question_only"]) must not edit;
    metadata["behaviour"]["protected"] overrides the protected path patterns."""
    from c2jax.tasks.behaviour import behaviour_reward_terms, check_no_reasoning_comments
    meta = getattr(task, "metadata", None) or {}
    beh = meta.get("behaviour") or {}
    question_only = bool(meta.get("question_only")) or beh.get("category") == "question"
    out = {"missing_final_message": float(not (final_message or "").strip())}
    if original_files is None or final_files is None:  # no end state: only what the episode said
        return {**{k: 0.0 for k in GRADED_KEYS}, **out, "comment_reasoning_lines": 0}
    orig, final = dict(original_files), dict(final_files)
    terms = behaviour_reward_terms(orig, final, final_message, list(tool_calls or []),
                                   protected=tuple(beh.get("protected") or DEFAULT_PROTECTED),
                                   question_only=question_only)
    out.update({"eager_edits": 1.0 - terms.get("no_edits", 1.0),
                "protected_paths": 1.0 - terms["protected_paths_untouched"],
                "debug_prints": 1.0 - terms["no_debug_prints"],
                "new_lint": 1.0 - terms["no_new_lint"]})
    out["comment_reasoning_lines"] = len(check_no_reasoning_comments(orig, final).details["problems"])
    return out
