"""What the harness asks of a policy: the public interface for anyone writing one.

A policy gets the episode's token context and returns the next assistant message as tokens
(`Policy.act -> PolicyOutput`); scripted policies subclass `TextPolicy` and return text. Besides
task turns, the harness may make two summary requests (c2jax.agent.summarize runs them):
  self-summary  the live context followed by render_user(SUMMARIZE_QUERY) + assistant_prefix();
  compaction    a separate context starting with render_system(COMPACTION_SYSTEM), whose user
                message is COMPACTION_PROMPT followed by the transcript as text.
The message format itself is c2jax.agent.chat_format.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from c2jax.agent import chat_format as cf

SUMMARIZE_QUERY = (
    "Your context is full. Summarize the conversation so far for yourself: what the task "
    "needs, what you found (exact names and values), what you changed, and what is left. You "
    "may think first; then write the summary between <|summary|> and <|/summary|>. Put your plan "
    "on one line starting PLAN: and each remaining to-do on a line starting TODO:. The "
    "conversation will continue from your summary only.")
COMPACTION_SYSTEM = "You compact long agent transcripts into short notes that let the agent continue."
COMPACTION_PROMPT = (
    "Summarize the following transcript of a coding agent so that it can continue the task from "
    "your summary alone. Keep the task, the actions taken, important tool output, and what is "
    "left. Write the summary between <|summary|> and <|/summary|>.\n\nTRANSCRIPT:\n")


@dataclasses.dataclass
class PolicyOutput:
    """The next assistant message as token ids, with what the trainer needs of them."""

    token_ids: list[int]
    logprobs: list[float] | None = None        # None: zeros (scripted)
    versions: list[int] | int | None = None    # None: the policy's version
    expert_ids: np.ndarray | None = None       # [n, N, K] int32


class Policy(Protocol):
    """Anything with a version and act(): the model (SamplerPolicy) or a scripted policy."""

    version: int

    def act(self, context: list[int], max_new_tokens: int, codec: cf.TokenCodec) -> PolicyOutput:
        ...


class TextPolicy:
    """Base for scripted policies: subclasses return the next message text."""

    version = 0

    def next_message(self, context: list[int], codec: cf.TokenCodec) -> str:
        raise NotImplementedError

    def act(self, context: list[int], max_new_tokens: int, codec: cf.TokenCodec) -> PolicyOutput:
        text = self.next_message(context, codec)
        if not text.endswith(cf.st.END_TURN):
            text += cf.st.END_TURN
        return PolicyOutput(codec.encode(text)[:max_new_tokens])
