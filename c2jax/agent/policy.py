"""Policies: given the episode's token context, produce the next assistant message.

Model policy: `SamplerPolicy` wraps a sampler
  sampler(context_token_ids, max_new_tokens, **kwargs)
      -> (new_token_ids, logprobs, versions, expert_ids or None)
(logprobs: one float per new token; versions: one int per token or a single int; expert_ids:
[n_new, N_moe_layers, K] ints). Its tokens go into the context unchanged (token in, token out).

Scripted text policies (`OraclePolicy`, `DoNothingPolicy`, `ScriptedPolicy`) write text,
encoded with the episode's tokenizer (the byte fallback by default).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from c2jax.agent import chat_format as cf
from c2jax.agent.policy_protocol import Policy, PolicyOutput, TextPolicy  # noqa: F401  (importable from here)


class ScriptedPolicy(TextPolicy):
    """Emits the given raw assistant messages in order, then a plain final message."""

    def __init__(self, messages: list[str], final: str = "Done."):
        self.messages = list(messages)
        self.final = final
        self.i = 0

    def next_message(self, context, codec) -> str:
        if self.i < len(self.messages):
            self.i += 1
            return self.messages[self.i - 1]
        return self.final


class OraclePolicy(TextPolicy):
    """Replays task.reference_solution (one call per turn, or a list = one parallel turn),
    then task.reference_message (or "Done.") as the final message."""

    def __init__(self, task: Any, calls_per_turn: int = 1):
        steps = []
        pending: list[dict] = []
        for item in task.reference_solution:
            if isinstance(item, (list, tuple)):
                if pending:
                    steps.append(pending)
                    pending = []
                steps.append(list(item))
            else:
                pending.append(item)
                if len(pending) >= calls_per_turn:
                    steps.append(pending)
                    pending = []
        if pending:
            steps.append(pending)
        self.steps = steps
        self.final = getattr(task, "reference_message", "") or "Done."
        self.i = 0

    def next_message(self, context, codec) -> str:
        if self.i < len(self.steps):
            self.i += 1
            return cf.render_assistant(calls=self.steps[self.i - 1])
        return cf.render_assistant(self.final)


class DoNothingPolicy(TextPolicy):
    """Answers at once without touching the repository (a floor for every benchmark)."""

    def __init__(self, message: str = "I did not make any changes."):
        self.message = message

    def next_message(self, context, codec) -> str:
        return cf.render_assistant(self.message)


class SamplerPolicy:
    """The model: calls the sampler on the exact token context.

    When the sampler takes `stop_token_ids` (e.g. c2jax.sampling.api.HarnessSampler), the ids of
    END_TURN and EOS are passed so generation stops at the end of the message; the runner also
    cuts any tokens after the first stop token.
    """

    def __init__(self, sampler: Callable[..., tuple], version: int | None = None, **sampler_kwargs):
        self.sampler = sampler
        self.version = int(getattr(sampler, "version", 0) if version is None else version)
        self.sampler_kwargs = sampler_kwargs
        self._takes_stop = _accepts(sampler, "stop_token_ids")

    def act(self, context: list[int], max_new_tokens: int, codec: cf.TokenCodec) -> PolicyOutput:
        kw = dict(self.sampler_kwargs)
        if self._takes_stop and "stop_token_ids" not in kw and codec.stop_ids:
            kw["stop_token_ids"] = sorted(codec.stop_ids)
        ids, logprobs, versions, experts = self.sampler(list(context), max_new_tokens, **kw)
        ids = [int(i) for i in ids]
        return PolicyOutput(ids, None if logprobs is None else [float(x) for x in logprobs],
                            versions, None if experts is None else np.asarray(experts, np.int32))


def _accepts(fn: Callable, name: str) -> bool:
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
