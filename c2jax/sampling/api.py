"""Public entry points: `generate` (batch of prompts x n samples) and `HarnessSampler` (the
callable the agent harness's SamplerPolicy drives, continuing live cache slots turn by turn).
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

from c2jax.sampling.engine import Completion, Request, Sampler


@dataclasses.dataclass
class GenerateOutput:
    """Per prompt (outer list) x sample (inner list)."""

    tokens: list[list[list[int]]]              # generated ids
    logprobs: list[list[np.ndarray]]           # behaviour logprobs (after temperature/top-k/top-p)
    raw_logprobs: list[list[np.ndarray]]       # log_softmax of the unmodified logits
    versions: list[list[np.ndarray]]           # policy version per generated token
    expert_ids: list[list[np.ndarray | None]]  # [len(prompt) + len(tokens), N, K] per input position
    finish_reason: list[list[str]]             # stop | length | max_len | stop_string
    completions: list[list[Completion]]
    stats: dict


def generate(cfg, params, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, temperature: float = 1.0,
             n: int = 1, seed: int = 0, top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
             stop_strings: Sequence[str] = (), detokenize: Callable | None = None, max_batch: int | None = None,
             max_len: int | None = None, chunk: int = 32, version: int = 0,
             sampler: Sampler | None = None, speculative: str = "none",
             quant_scope: str = "experts") -> GenerateOutput:
    """Sample n completions of every prompt (temperature 0 = greedy).

    Sample j of prompt i uses the key fold_in(fold_in(key(seed), i), j), so outputs do not
    depend on max_batch or on which other prompts are in the call. Pass `sampler` to reuse
    a Sampler (and its compiled functions / caches); speculative / quant_scope: see Sampler."""
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if sampler is None:
        longest = max(len(p) for p in prompts)
        max_len = max_len or _round_up(longest + max_new_tokens + 1, 16)
        max_batch = max_batch or min(len(prompts) * n, 64)
        max_batch = max(max_batch, n)
        sampler = Sampler(cfg, params, max_batch=max_batch, max_len=max_len, chunk=chunk, version=version,
                          speculative=speculative, quant_scope=quant_scope)
    rids = [sampler.submit(Request(p, max_new_tokens=max_new_tokens, n=n, temperature=temperature, top_p=top_p,
                                   top_k=top_k, stop_token_ids=tuple(stop_token_ids),
                                   stop_strings=tuple(stop_strings), detokenize=detokenize, seed=seed,
                                   request_id=i, reuse_prefix=False))
            for i, p in enumerate(prompts)]
    sampler.run_until_done()
    comps = [sampler.results(r) for r in rids]
    pick = lambda f: [[f(c) for c in cs] for cs in comps]
    return GenerateOutput(
        tokens=pick(lambda c: c.tokens), logprobs=pick(lambda c: c.logprobs),
        raw_logprobs=pick(lambda c: c.raw_logprobs), versions=pick(lambda c: c.versions),
        expert_ids=pick(lambda c: c.expert_ids), finish_reason=pick(lambda c: c.finish_reason),
        completions=comps,
        stats={"prefill_tokens": sampler.prefill_tokens, "decode_steps": sampler.decode_steps,
                   "generated_tokens": sampler.generated_tokens, "spec_drafted": sampler.spec_drafted,
                   "spec_accepted": sampler.spec_accepted})


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def turn_request(context_token_ids, max_new_tokens: int, max_len: int, **kw) -> Request:
    """One harness turn's Request (n=1, reusing any cached prefix): the context as ints and
    max_new_tokens capped by the room left in max_len; ValueError when there is none."""
    context = [int(t) for t in context_token_ids]
    room = max_len - 1 - len(context)
    if room < 1:
        raise ValueError(f"context of {len(context)} tokens leaves no room in max_len={max_len}")
    return Request(context, max_new_tokens=min(int(max_new_tokens), room), n=1, reuse_prefix=True, **kw)


class HarnessSampler:
    """The agent harness's model callable:

        sampler(context_token_ids, max_new_tokens, stop_token_ids=None, temperature=None, ...)
            -> (new_token_ids, logprobs, versions, expert_ids [n_new, N, K] or None)

    Token in, token out: when the context extends (or shares a prefix with) a conversation
    still cached in an idle slot, only the new tokens are prefilled (`prefill_tokens` counts
    them); otherwise the context is prefilled into the least recently used slot. Calls from
    several threads are serialized."""

    def __init__(self, sampler: Sampler, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop_token_ids: Sequence[int] = (), seed: int = 0):
        self.sampler = sampler
        self.defaults = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                             "stop_token_ids": tuple(stop_token_ids)}
        self.seed = seed
        self._lock = threading.Lock()
        self.last: Completion | None = None

    @property
    def version(self) -> int:
        return self.sampler.version

    @property
    def prefill_tokens(self) -> int:
        return self.sampler.prefill_tokens

    def swap_params(self, params, version: int) -> None:
        self.sampler.swap_params(params, version)

    def __call__(self, context_token_ids, max_new_tokens: int, stop_token_ids=None, temperature=None,
                 top_p=None, top_k=None, **_):
        kw = dict(self.defaults)
        for k, v in (("stop_token_ids", stop_token_ids), ("temperature", temperature), ("top_p", top_p),
                     ("top_k", top_k)):
            if v is not None:
                kw[k] = tuple(v) if k == "stop_token_ids" else v
        if max_new_tokens <= 0:
            return [], [], [], None
        req = turn_request(context_token_ids, max_new_tokens, self.sampler.S, seed=self.seed, **kw)
        with self._lock:
            rid = self.sampler.submit(req)
            self.sampler.run_until_done(rid)
            (c,) = self.sampler.results(rid)
        self.last = c
        return c.tokens, c.logprobs.tolist(), c.versions.tolist(), c.completion_expert_ids
