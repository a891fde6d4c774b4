"""The jitted sampler: a fixed set of cache slots, jitted prefill and on-device decode chunks
(cache and row state donated), continuous batching, prefix reuse for multi-turn, per-token
logprobs / policy versions / routed expert ids, and in-flight weight swaps.

Letters: B slots (max_batch), S cache slots per row (max_len), b prefill rows, L prefill
length (bucketed), M fan-out rows (padded to B), C decode steps per chunk, N MoE layers,
K experts per token, X stop ids per row, V vocab.

Cache layout: the model's stacked caches (`c2jax.models.init_cache`): MLA keeps only the
latent [n, B, S, C_kv] and rotary key [n, B, S, R] and decodes with the absorbed
up-projection; GQA keeps K/V. Slot index == token position, so a row's cache holds exactly
positions 0..pos-1 ("pos" below = tokens in the cache); stale entries past pos are never
visible (attention masks slot <= query position) and are overwritten before they are read.

Row life cycle (per slot, all on device inside one chunk):
  prefill   writes the prompt (or only the suffix not already cached), samples token 1
  live      each decode step consumes the pending token `cur` at `pos` (writes its KV,
            records its routing) and, unless `done`, samples the next one
  done      set when a stop id / max_new_tokens / cache end is hit; the row stays live for
            one more "flush" step so the final token's KV and routing are recorded too
            (needed for multi-turn continuation and for router replay of every position)
  idle      not live; writes are sent to an out-of-range position (dropped), so the cached
            conversation survives until the slot is reused.
Expert ids are therefore recorded per *input position* of the full sequence: prompt
positions from prefill, each later position from the decode step that consumed it. This is
what the trainer's forward routes on the same sequence (router replay input).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from c2jax.models import transformer as tfm
from c2jax.ops.experts import decode_layout
from c2jax.ops.target import current_target
from c2jax.sampling import decode_weights
from c2jax.sampling import logits as lg
from c2jax.sampling import unrolled
from c2jax.sampling.rows import (
    FINISH,
    MAX_STOP_IDS,
    finish_codes,
    init_row_state,
    prefill_compute,
    write_rows,
)
from c2jax.sampling.rows import RowState, prefill_rows  # noqa: F401  (importable from here, as before)


# ----------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Request:
    """One prompt to complete `n` times (the RL group shares one prefill)."""

    prompt: Sequence[int]
    max_new_tokens: int = 64
    n: int = 1
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0                   # 1.0 = off
    top_k: int = 0                       # 0 = off
    stop_token_ids: Sequence[int] = ()   # finish after emitting one of these (it is kept)
    stop_strings: Sequence[str] = ()     # needs `detokenize`; checked between chunks
    detokenize: Callable[[list[int]], str] | None = None
    seed: int = 0
    request_id: int | None = None        # key derivation; assigned from a counter when None
    reuse_prefix: bool = True            # continue from the idle slot sharing the longest prefix


@dataclasses.dataclass
class Completion:
    """One finished sample."""

    request_id: int
    sample_index: int
    tokens: list[int]                    # generated ids (stop id included)
    logprobs: np.ndarray                 # f32 behaviour logprob per generated token
    raw_logprobs: np.ndarray             # f32 log_softmax of the unmodified logits
    versions: np.ndarray                 # int32 policy version per generated token
    expert_ids: np.ndarray | None        # int32 [len(prompt) + len(tokens), N, K] per input position
    finish_reason: str                   # stop | length | max_len | stop_string
    prompt_len: int
    prefilled: int                       # prompt tokens actually run through prefill (shared by the group)
    slot: int

    @property
    def completion_expert_ids(self):
        return None if self.expert_ids is None else self.expert_ids[self.prompt_len:]


def sampler_model_cfg(cfg, exact_moe: bool = True):
    """The model config the sampler runs. With exact_moe, MoE dispatch never drops tokens (so a
    row's output cannot depend on the other rows): capacity dispatch gets capacity_factor =
    experts / top-k (capacity = tokens), grouped dispatch is dropless already."""
    m = ml_collections.ConfigDict(tfm.model_cfg(cfg).to_dict())
    if exact_moe:
        from c2jax.models.moe import make_dropless
        make_dropless(m)
    return m


# ----------------------------------------------------------------------------- jitted kernels


@functools.partial(jax.jit, static_argnums=(2, 3))
def _gather_window(cache, src_b, P: int, n_dense: int):
    """Rows src_b of the caches, positions [0, P) only, stacked [Y, b, P, ...]; cache is stacked
    or per layer (a list whose first n_dense layers are dense)."""
    if isinstance(cache, list):
        return unrolled.stack_layers(n_dense, [jax.tree.map(lambda c: c[src_b, :P], layer) for layer in cache])
    return jax.tree.map(lambda c: c[:, src_b, :P], cache)


_write_rows = jax.jit(write_rows, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=32)
def _kernels(model_json: str, S: int, B: int):
    """(prefill, decode, N). prefill runs the b source rows' cache windows alone (the caller
    gathers them and writes the new ones back: Sampler._run_prefill) on the model weights
    (DecodeWeights.model); decode takes the DecodeWeights and runs decode_weights.decode_step
    (with split weights, per-layer caches)."""
    m = ml_collections.ConfigDict(json.loads(model_json))
    _, N = tfm.layer_counts(m)

    def model_step(params, tokens, positions, cache):
        return tfm.forward_with_cache(m, params, tokens, positions, cache)

    @functools.partial(jax.jit, static_argnames=("use_filter",))
    def prefill(params, src_win, tokens_bL, start_b, len_b, dest_src_M, seed_M, rid_M, sidx_M, max_new_M,
                temp_M, top_k_M, top_p_M, stop_MX, use_filter=True):
        """prefill_compute on the b source rows' caches, positions [0, P) (all a prefill reads
        or writes; zeros past P are never read): returns their new caches' positions [0, P),
        the destination rows' RowState and (tok, lp, raw, code, experts)."""
        P = jax.tree.leaves(src_win)[0].shape[2]
        rows = jax.tree.map(lambda c: jnp.pad(c, [(0, 0), (0, 0), (0, S - P)] + [(0, 0)] * (c.ndim - 3)), src_win)
        step = lambda t, p, c: (model_step(params, t, p, c), None)  # noqa: E731
        new_rows, upd, outs, _, _ = prefill_compute(step, N, S, rows, tokens_bL, start_b, len_b, dest_src_M, seed_M,
                                                    rid_M, sidx_M, max_new_M, temp_M, top_k_M, top_p_M, stop_MX,
                                                    use_filter)
        return jax.tree.map(lambda c: c[:, :, :P], new_rows), upd, outs

    @functools.partial(jax.jit, donate_argnums=(1, 2), static_argnames=("C", "use_filter", "span"))
    def decode(weights, cache, state, min_live, C=32, use_filter=True, span=None):
        """Up to C decode steps on device; stops early when fewer than min_live rows are live
        (the host then refills freed slots) or when none is. span (split decode): attention reads
        cache slots [0, span) only (decode cost follows the rows' lengths, not S); the loop also
        stops before a live row's position reaches span."""
        span = span if weights.split is not None and span is not None and span < S else None
        K = m.num_experts_per_tok
        bufs = {"tok": jnp.full((C, B), -1, jnp.int32), "lp": jnp.zeros((C, B), jnp.float32),
                    "raw": jnp.zeros((C, B), jnp.float32), "gen": jnp.zeros((C, B), bool),
                    "used": jnp.zeros((C, B), bool), "code": jnp.zeros((C, B), jnp.int32)}
        if N:
            bufs["experts"] = jnp.zeros((C, N, B, K), jnp.int32)

        def cond(carry):
            i, _, st, _ = carry
            n_live = jnp.sum(st.live)
            more = (i < C) & (n_live > 0) & (n_live >= min_live)
            if span is not None:
                more &= jnp.max(jnp.where(st.live, st.pos, 0)) < span
            return more

        def body(carry):
            i, cache, st, bufs = carry
            positions = jnp.where(st.live, st.pos, S)[:, None]
            out = decode_weights.decode_step(m, weights, st.cur[:, None], positions, cache, span)
            gen = st.live & ~st.done
            tok, lp, raw = lg.select_tokens(out.logits[:, 0], lg.step_keys(st.key, st.ngen),
                                            st.temp, st.top_k, st.top_p, use_filter)
            ngen = st.ngen + gen
            code = jnp.where(gen, finish_codes(tok, ngen, st.pos + 1, st.max_new, st.stop, S), 0)
            new = st._replace(
                cur=jnp.where(gen, tok, st.cur), pos=jnp.where(st.live, st.pos + 1, st.pos),
                live=st.live & ~st.done, done=st.done | (code > 0), ngen=ngen,
                reason=jnp.where(code > 0, code, st.reason))
            row = {"tok": jnp.where(gen, tok, -1), "lp": lp, "raw": raw, "gen": gen, "used": st.live, "code": code}
            if N:
                row["experts"] = out.aux["expert_ids"][:, :, 0]
            bufs = {k: bufs[k].at[i].set(row[k]) for k in bufs}
            return i + 1, out.cache, new, bufs

        # split: the cache is per layer (the Sampler keeps it so between chunks), each step
        # updating the layers' buffers in place
        i, cache, state, bufs = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, state, bufs))
        return cache, state, i, bufs

    return prefill, decode, N


def decode_program(model_cfg, max_len: int, max_batch: int):
    """A new instance of the sampler's jitted decode chunk for the scanned model (the form
    accelerators run): decode(weights, cache, state, min_live, C=32, use_filter=True) -> (cache,
    state, steps, buffers). New, not the Sampler's cached one, so lowering it traces the model (and
    records the kernel choices) every time."""
    return _kernels.__wrapped__(model_cfg.to_json(), int(max_len), int(max_batch))[1]


SPAN_MIN = 128   # smallest attention span of a decode chunk (spans double up to the cache size)


def _bucket(n: int, lo: int, hi: int, mult: int = 2) -> int:
    b = lo
    while b < n:
        b *= mult
    return min(b, hi)


# ----------------------------------------------------------------------------- host side


@dataclasses.dataclass
class _Row:
    req: Request
    rid: int
    sample: int
    group: _Group
    prompt_len: int
    tokens: list = dataclasses.field(default_factory=list)
    lps: list = dataclasses.field(default_factory=list)
    raws: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    reason: str = ""
    finished: bool = False
    slot: int = -1
    expert_ids: Any = None


@dataclasses.dataclass
class _Group:
    req: Request
    rid: int
    rows: list = dataclasses.field(default_factory=list)
    prefilled: int = 0
    completions: list | None = None


class MeshLayout:
    """Where a Sampler on a mesh keeps things: params by the run's logical rules (c2jax.models.
    param_shardings), the cache and row state with their slot dim over the batch axes (when they
    divide the slots), everything traced under `activate(cfg, mesh)`. compile-check lays out the
    decode program it compiles the same way."""

    def __init__(self, cfg, mesh, slots: int):
        from c2jax.parallel.mesh import logical_to_mesh_spec
        self.cfg, self.mesh = cfg, mesh
        spec = logical_to_mesh_spec(PartitionSpec("batch"), cfg, mesh)[0]
        names = () if spec is None else (spec if isinstance(spec, tuple) else (spec,))
        self.batch_spec = spec if names and slots % int(np.prod([mesh.shape[a] for a in names])) == 0 else None

    def active(self):
        from c2jax.parallel.mesh import activate
        return activate(self.cfg, self.mesh)

    def param_shardings(self, params):
        from c2jax.models import param_shardings
        return param_shardings(self.cfg, self.mesh, shapes_tree=params)

    def cache_shardings(self, cache):
        """[layers, slots, ...] cache leaves: slots over the batch axes."""
        return jax.tree.map(lambda x: NamedSharding(self.mesh, PartitionSpec(None, self.batch_spec)), cache)

    def row_shardings(self, state):
        """[slots, ...] row-state leaves: slots over the batch axes."""
        return jax.tree.map(lambda x: NamedSharding(self.mesh, PartitionSpec(self.batch_spec)), state)


def _split_by_default(model_cfg) -> bool:
    """Whether this process's device decodes through the unrolled step by default: the registry
    picks a split or packed decode layout for it (c2jax.ops.experts.decode_layout), not the stacks."""
    return decode_layout(current_target(), model_cfg) != "float"


SPECULATIVE_MODES = ("auto", "mtp", "none")   # Sampler(speculative=...); c2jax.rl.config names the same


def auto_speculative(model_cfg, split_decode, mesh, decode_devices: int) -> str:
    """speculative="auto": "mtp" where the model has MTP heads and one device decodes with the
    scanned model (an accelerator, split_decode=False), else "none". On CPU the split decode
    step (c2jax.sampling.unrolled) is the faster plain path and speculation cannot use it (the
    trade-off: experiments/bench/speculative.py); the speculative caches have no mesh layout yet."""
    if not int(model_cfg.num_mtp_layers) or decode_devices != 1 or split_decode or mesh is not None:
        return "none"
    if split_decode is None and _split_by_default(model_cfg) and unrolled.supported(model_cfg) is None:
        return "none"
    return "mtp"


class Sampler:
    """Reusable jitted sampler over `max_batch` cache slots of `max_len` positions.

        s = Sampler(cfg, params, max_batch=8, max_len=512)
        rid = s.submit(Request(prompt, max_new_tokens=64, n=4))
        s.run_until_done()            # or step_chunk() in your own loop
        s.results(rid)                # list[Completion] (n of them)
        s.swap_params(new, version)   # in flight: takes effect at the next decode chunk

    Options: chunk (decode steps per on-device loop between host checks), exact_moe (no
    token dropping: rows cannot influence each other), cache_dtype,
    speculative ("none" | "mtp": the MTP heads draft model.num_mtp_layers tokens per step, one
    main-model forward verifies them; c2jax.sampling.speculative | "auto": auto_speculative). Quantized weights: set
    cfg.model.quant (int8/mxfp8/nvfp4); quant_scope picks what is stored pre-quantized, once
    per weight version (c2jax.sampling.quantized): "experts" (default; bit-identical to the
    model's on-the-fly quantized experts), "all" (also dense projections, weight-only) or
    "none" (float params, experts quantized on the fly every step). split_decode (default: on
    CPU for float weights without speculation): decode with c2jax.sampling.unrolled (layer
    loop unrolled, per-layer and per-expert weight buffers, read in place; holds that second
    copy of the weights, rebuilt by swap_params); False runs the model's scanned forward.
    decode_devices (split decode only): split each decode step's weight reads over this many
    devices (on CPU, host devices: XLA_FLAGS=--xla_force_host_platform_device_count=n; one
    device's matmuls run one at a time on one core): experts, attention heads and the output
    head (unrolled.split_params); the cache (split by KV head) and row state live on those
    devices, and a prefill moves only the positions it reads or writes of its source rows to the
    params' device and of its new rows back (moving the whole cache each way, as before, took
    39 ms for batch 8 x 512 positions of the 89M model and 0.87 s for 32 x 1024). Same math as one device (float sums may differ in
    the last bits).

    Attributes: weights (decode_weights.DecodeWeights: the layouts decode reads), version (current policy version), prefill_tokens (tokens run through
    prefill, counted once per shared group), prefill_calls, decode_steps, generated_tokens,
    spec_drafted / spec_accepted (MTP draft tokens proposed / accepted).
    """

    def __init__(self, cfg, params, max_batch: int = 8, max_len: int = 512, chunk: int = 32,
                 version: int = 0, exact_moe: bool = True, cache_dtype=None,
                 speculative: str = "none", quant_scope: str = "experts", split_decode: bool | None = None,
                 decode_devices: int = 1, mesh=None):
        if speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, got {speculative!r}")
        if quant_scope not in ("none", "experts", "all"):
            raise ValueError(f"quant_scope must be 'none', 'experts' or 'all', got {quant_scope!r}")
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"Sampler needs max_batch >= 1 and max_len >= 2, got {max_batch}, {max_len}")
        self.model_cfg = sampler_model_cfg(cfg, exact_moe)
        self.B, self.S, self.chunk = int(max_batch), int(max_len), int(chunk)
        if mesh is not None:   # the scanned decode program compile-check compiles, on the sampler's mesh
            if speculative == "mtp":
                raise ValueError("speculative='mtp' runs on one device: its caches have no mesh layout yet "
                                 "(use speculative='auto' or 'none' with a mesh)")
            if split_decode:
                raise ValueError("a Sampler on a mesh runs the scanned decode program; split_decode=True is "
                                 "the one-process CPU layout")
            if decode_devices != 1:
                raise ValueError("a Sampler on a mesh lays decode out by the mesh; decode_devices must be 1")
            split_decode = False
        if speculative == "auto":
            speculative = auto_speculative(self.model_cfg, split_decode, mesh, decode_devices)
        why_not = unrolled.supported(self.model_cfg) or ("speculative decoding" if speculative != "none" else None)
        if split_decode is None:
            split_decode = why_not is None and _split_by_default(self.model_cfg)
        elif split_decode and why_not:
            raise ValueError(f"split_decode=True does not support {why_not}")
        self.split_decode = bool(split_decode)
        self.layout = MeshLayout(cfg, mesh, self.B) if mesh is not None else None
        if decode_devices != 1 and not self.split_decode:
            raise ValueError(f"decode_devices={decode_devices} needs the split decode step (split_decode=True; "
                             f"not available for {why_not or 'split_decode=False'})")
        self._mesh = unrolled.decode_mesh(int(decode_devices))
        self._prefill, self._decode, self.num_moe_layers = _kernels(self.model_cfg.to_json(), self.S, self.B)
        self.quant_scope = quant_scope if self.model_cfg.quant != "none" else "none"
        self.weights = self._prepare(params)
        self.version = int(version)
        self.cache = tfm.init_cache(self.model_cfg, self.B, self.S, cache_dtype)
        self.cache = jax.tree.map(lambda a: jnp.array(a), self.cache)  # materialize (init broadcasts)
        self.speculative = speculative
        if speculative == "mtp":
            from c2jax.sampling import speculative as spec
            self._prefill, self._decode, _ = spec.kernels(self.model_cfg.to_json(), self.S, self.B)
            self.cache = spec.init_cache(self.model_cfg, self.B, self.S, cache_dtype)
        if self.split_decode:   # per layer, as the split decode step reads and updates it
            self.cache = unrolled.split_cache(self.cache)
        self.spec_drafted = self.spec_accepted = 0
        self.state = init_row_state(self.B)
        if self._mesh is not None:   # they stay there: prefill moves only the rows it reads and writes
            self.cache = jax.device_put(self.cache, unrolled.cache_shardings(self.model_cfg, self.cache, self._mesh))
            self.state = jax.device_put(self.state, NamedSharding(self._mesh, PartitionSpec()))
        if self.layout is not None:
            self.cache = jax.device_put(self.cache, self.layout.cache_shardings(self.cache))
            self.state = jax.device_put(self.state, self.layout.row_shardings(self.state))
        self._lock = threading.RLock()
        self._rid = itertools.count()
        self._waiting: list[_Group] = []
        self._groups: dict[int, _Group] = {}
        self.slot_row: list[_Row | None] = [None] * self.B          # live row per slot
        self.slot_tokens: list[list[int]] = [[] for _ in range(self.B)]  # tokens whose KV is cached
        self.slot_experts: list[list[np.ndarray]] = [[] for _ in range(self.B)]  # routing per cached position
        # oldest policy version whose weights wrote part of each slot's cache (None: empty)
        self.slot_oldest_version: list[int | None] = [None] * self.B
        self._slot_used = [0] * self.B
        self._tick = itertools.count(1)
        self.prefill_tokens = 0
        self.prefill_calls = 0
        self.stale_prefix_skips = 0  # shared prefixes not reused because older weights wrote them
        self.decode_steps = 0
        self.generated_tokens = 0

    # -- weights
    def swap_params(self, params, version: int) -> None:
        """New weights for every later decode chunk / prefill; caches and live rows are kept.
        With quantized storage the new weights are quantized once, here."""
        weights = self._prepare(params)
        with self._lock:
            self.weights = weights
            self.version = int(version)

    def _prepare(self, params) -> decode_weights.DecodeWeights:
        if self.layout is not None:
            params = jax.device_put(params, self.layout.param_shardings(params))  # no copy where they lie
            with self.layout.active():
                return decode_weights.prepare(self.model_cfg, params, quant_scope=self.quant_scope)
        return decode_weights.prepare(self.model_cfg, params, quant_scope=self.quant_scope,
                                      split_decode=self.split_decode, mesh=self._mesh)

    def _active(self):
        """The sampler mesh's logical rules while its programs trace and run (nothing without one)."""
        return self.layout.active() if self.layout is not None else contextlib.nullcontext()

    # -- requests
    def submit(self, request: Request) -> int:
        """Queue a request (n samples); returns its request id."""
        r = request
        prompt = [int(t) for t in r.prompt]
        V = self.model_cfg.vocab_size
        if not prompt:
            raise ValueError("Request.prompt is empty; give at least one token")
        if len(prompt) >= self.S:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_len={self.S} (need len < max_len)")
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"prompt token ids must be in [0, {V})")
        if not 1 <= r.n <= self.B:
            raise ValueError(f"Request.n={r.n} must be in [1, max_batch={self.B}]")
        if r.max_new_tokens < 1:
            raise ValueError("Request.max_new_tokens must be >= 1")
        if len(r.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop_token_ids per request")
        if r.stop_strings and r.detokenize is None:
            raise ValueError("Request.stop_strings needs Request.detokenize (ids -> text)")
        r = dataclasses.replace(r, prompt=prompt)
        with self._lock:
            rid = next(self._rid) if r.request_id is None else int(r.request_id)
            if rid in self._groups:
                raise ValueError(f"request id {rid} is already in use")
            g = _Group(r, rid)
            g.rows = [_Row(r, rid, j, g, len(prompt)) for j in range(r.n)]
            self._groups[rid] = g
            self._waiting.append(g)
        return rid

    def done(self, rid: int) -> bool:
        return self._groups[rid].completions is not None

    def results(self, rid: int, pop: bool = True) -> list[Completion]:
        g = self._groups[rid]
        if g.completions is None:
            raise RuntimeError(f"request {rid} is not finished; call run_until_done()")
        if pop:
            del self._groups[rid]
        return g.completions

    def pending(self) -> int:
        return len(self._waiting) + sum(r is not None for r in self.slot_row)

    # -- scheduling
    def _free_slots(self):
        return [s for s in range(self.B) if self.slot_row[s] is None]

    def _admit(self):
        """Prefill as many waiting groups as free slots allow (FIFO), in one batched call."""
        free = self._free_slots()
        batch = []  # (group, src_slot, start, dest_slots)
        reserved: set[int] = set()
        while self._waiting and len(free) - len(reserved) >= self._waiting[0].req.n:
            g = self._waiting.pop(0)
            prompt = g.req.prompt
            src, start = None, 0
            if g.req.reuse_prefix:
                best = 0
                for s in free:
                    if s in reserved:
                        continue
                    toks = self.slot_tokens[s]
                    lcp = _common_prefix(toks, prompt)
                    if lcp > best and not self._reusable(s, lcp):
                        self.stale_prefix_skips += 1
                        continue
                    if lcp > best:
                        best, src = lcp, s
                start = min(best, len(prompt) - 1)
            avail = [s for s in free if s not in reserved]
            # prefer the source slot itself, then least recently used slots
            avail.sort(key=lambda s: (s != src, self._slot_used[s]))
            dest = avail[:g.req.n]
            if src is None:
                src = dest[0]
            reserved.update(dest)
            batch.append((g, src, start, dest))
        if batch:
            self._run_prefill(batch)

    def _reusable(self, s, lcp) -> bool:
        """May a new request reuse slot s's first lcp cached positions? Always when older weights
        wrote none of them; across a weight swap only to continue the slot's own sequence (a later
        turn of the same episode, the in-flight update keeping its cache): a sibling episode that
        merely shares the system prompt and task is prefilled fresh at the current version, so
        each new episode's behaviour policy is the version its tokens are tagged with."""
        return self.slot_oldest_version[s] == self.version or lcp == len(self.slot_tokens[s])

    def _run_prefill(self, batch):
        B, S = self.B, self.S
        b_real = len(batch)
        b = _bucket(b_real, 1, B, 4)   # few distinct shapes: each is a compile
        L = _bucket(max(len(g.req.prompt) - start for g, _, start, _ in batch), 16, S)
        tokens = np.zeros((b, L), np.int32)
        start_b = np.zeros((b,), np.int32)
        len_b = np.zeros((b,), np.int32)
        src_b = np.zeros((b,), np.int32)
        # destination rows, padded (dest = B: dropped) to a bucket of their count, not to B: the
        # write-back gathers one new cache row per entry (B entries for one prompt cost 67 ms of
        # a 240 ms prefill at 32 slots x 1024 positions)
        Mb = _bucket(sum(len(dest) for *_, dest in batch), 1, B, 4)
        M = {"dest": np.full((Mb,), B, np.int32), "src": np.zeros((Mb,), np.int32), "seed": np.zeros((Mb,), np.int32),
             "rid": np.zeros((Mb,), np.int32), "sidx": np.zeros((Mb,), np.int32), "max_new": np.ones((Mb,), np.int32),
             "temp": np.ones((Mb,), np.float32), "top_k": np.zeros((Mb,), np.int32), "top_p": np.ones((Mb,), np.float32),
             "stop": np.full((Mb, MAX_STOP_IDS), -1, np.int32)}
        rows, k = [], 0
        for i, (g, src, start, dest) in enumerate(batch):
            r = g.req
            suffix = r.prompt[start:]
            tokens[i, :len(suffix)] = suffix
            start_b[i], len_b[i], src_b[i] = start, len(suffix), src
            g.prefilled = len(suffix)
            self.prefill_tokens += len(suffix)
            for j, s in enumerate(dest):
                M["dest"][k], M["src"][k], M["seed"][k] = s, i, r.seed
                M["rid"][k], M["sidx"][k], M["max_new"][k] = g.rid, j, r.max_new_tokens
                M["temp"][k], M["top_k"][k], M["top_p"][k] = r.temperature, r.top_k, r.top_p
                M["stop"][k, :len(r.stop_token_ids)] = list(r.stop_token_ids)
                rows.append((k, i, g.rows[j], s, src, start, len(suffix)))
                k += 1
        use_filter = any(g.req.top_k > 0 or g.req.top_p < 1.0 for g, *_ in batch)
        with self._lock:
            params, version = self.weights.model, self.version
        with self._active():
            if self.speculative == "mtp":   # its own fused kernel over the model and MTP caches
                self.cache, self.state, (tok, lp, raw, code, experts) = self._prefill(
                    params, self.cache, self.state, tokens, start_b, len_b, src_b, M["dest"], M["src"], M["seed"],
                    M["rid"], M["sidx"], M["max_new"], M["temp"], M["top_k"], M["top_p"], M["stop"],
                    use_filter=use_filter)
            else:
                # only the source rows' first P positions (all a prefill reads or writes) go to the
                # prefill and only the new rows' come back; with decode devices the cache stays on
                # them and just these windows move
                P = _bucket(int(np.max(start_b + len_b)), 16, S)
                src_win = _gather_window(self.cache, src_b, P, tfm.layer_counts(self.model_cfg)[0])
                if self._mesh is not None:
                    src_win = jax.device_put(src_win, self._mesh.devices.flat[0])
                new_win, upd, (tok, lp, raw, code, experts) = self._prefill(
                    params, src_win, tokens, start_b, len_b, M["src"], M["seed"], M["rid"], M["sidx"], M["max_new"],
                    M["temp"], M["top_k"], M["top_p"], M["stop"], use_filter=use_filter)
                if self._mesh is not None:
                    new_win = jax.device_put(new_win, unrolled.cache_shardings(self.model_cfg, new_win, self._mesh))
                    upd = jax.device_put(upd, NamedSharding(self._mesh, PartitionSpec()))
                self.cache, self.state = _write_rows(self.cache, self.state, new_win, upd, M["dest"], M["src"])
        self.prefill_calls += 1
        tok, lp, raw, code, ex = jax.device_get((tok, lp, raw, code, experts))  # ex: [N, b, L, K] or None
        # cache bookkeeping: every dest slot holds src's cached prefix + the prefilled suffix
        old = {}
        for *_, src, start, _n in rows:
            if src not in old:
                oldest = self.slot_oldest_version[src] if start else None
                old[src] = (list(self.slot_tokens[src][:start]), list(self.slot_experts[src]), oldest)
        for _, i, row, s, src, start, n in rows:
            toks, exps, oldest = old[src]
            self.slot_tokens[s] = toks + row.req.prompt[start:start + n]
            self.slot_oldest_version[s] = version if oldest is None else min(oldest, version)
            prev = _cat(exps)[:start] if exps else None
            new = None if ex is None else np.transpose(ex[:, i, :n], (1, 0, 2))
            self.slot_experts[s] = [e for e in (prev, new) if e is not None]
        for k, _i, row, s, *_ in rows:
            self.slot_row[s] = row
            self._slot_used[s] = next(self._tick)
            self._append(row, [int(tok[k])], [float(lp[k])], [float(raw[k])], version)
            if code[k]:
                row.reason = FINISH[int(code[k])]

    def _append(self, row, toks, lps, raws, version):
        row.tokens += toks
        row.lps += lps
        row.raws += raws
        row.versions += [version] * len(toks)
        self.generated_tokens += len(toks)

    def step_chunk(self) -> int:
        """Admit waiting requests, run one decode chunk, collect finished rows. Returns steps run."""
        self._admit()
        if not any(r is not None for r in self.slot_row):
            return 0
        use_filter = any(r is not None and (r.req.top_k > 0 or r.req.top_p < 1.0) for r in self.slot_row)
        n_live = sum(r is not None for r in self.slot_row)
        # with requests waiting, return as soon as a row frees its slot (continuous batching)
        min_live = n_live if self._waiting else 0
        with self._lock:
            weights, version = self.weights, self.version
        kw = {}
        if self.split_decode and self.speculative == "none":  # attend over the slots the rows can reach
            pos, live = jax.device_get((self.state.pos, self.state.live))
            top = int(pos[live].max()) if live.any() else 0
            kw["span"] = _bucket(top + self.chunk + 1, min(SPAN_MIN, self.S), self.S)
        with self._active():
            self.cache, self.state, n_steps, bufs = self._decode(weights, self.cache, self.state, min_live,
                                                                 C=self.chunk, use_filter=use_filter, **kw)
        # one batched transfer, sliced on the host (slicing on device would dispatch one op per
        # buffer and compile a new slice for every distinct n)
        n_steps, bufs = jax.device_get((n_steps, bufs))
        n = int(n_steps)
        spec = bufs.pop("spec", None)  # speculative: n counts buffer entries, spec = [steps, drafted, accepted]
        self.decode_steps += n if spec is None else int(spec[0])
        if spec is not None:
            self.spec_drafted += int(spec[1])
            self.spec_accepted += int(spec[2])
        h = {k: v[:n] for k, v in bufs.items()}
        for s in range(self.B):
            row = self.slot_row[s]
            if row is None:
                continue
            used, gen = h["used"][:, s], h["gen"][:, s]
            if gen.any():
                self._append(row, h["tok"][gen, s].tolist(), h["lp"][gen, s].tolist(),
                             h["raw"][gen, s].tolist(), version)
                codes = h["code"][gen, s]
                if codes.any() and not row.reason:
                    row.reason = FINISH[int(codes[codes > 0][0])]
            n_used = int(used.sum())
            if n_used:
                have = len(self.slot_tokens[s]) - row.prompt_len
                self.slot_tokens[s] += row.tokens[have:have + n_used]
                if "experts" in h:
                    self.slot_experts[s].append(h["experts"][used, :, s])
            if row.req.stop_strings and row.reason != "stop_string":
                self._check_stop_strings(row, s)
            # finished once flushed: the slot caches prompt + every generated token
            if row.reason and len(self.slot_tokens[s]) == row.prompt_len + len(row.tokens):
                self._finish(row, s)
        return n

    def _check_stop_strings(self, row, s):
        text_of = row.req.detokenize
        if not any(x in text_of(row.tokens) for x in row.req.stop_strings):
            return
        j = len(row.tokens)
        for j in range(1, len(row.tokens) + 1):  # shortest prefix containing a stop string
            if any(x in text_of(row.tokens[:j]) for x in row.req.stop_strings):
                break
        self.generated_tokens -= len(row.tokens) - j
        row.tokens, row.lps, row.raws, row.versions = (row.tokens[:j], row.lps[:j], row.raws[:j],
                                                      row.versions[:j])
        row.reason = "stop_string"
        # rewind the slot to just before the last kept token; the next chunk flushes that token
        pos_last = row.prompt_len + j - 1
        self.slot_tokens[s] = self.slot_tokens[s][:pos_last]
        if self.slot_experts[s]:
            self.slot_experts[s] = [_cat(self.slot_experts[s])[:pos_last]]
        st = self.state   # edited where it lies (on the decode mesh: replicated); the cache is untouched
        self.state = st._replace(cur=st.cur.at[s].set(row.tokens[-1]), pos=st.pos.at[s].set(pos_last),
                                 live=st.live.at[s].set(True), done=st.done.at[s].set(True))

    def _finish(self, row, s):
        row.finished = True
        row.slot = s
        row.expert_ids = _cat(self.slot_experts[s]) if self.slot_experts[s] else None
        self.slot_row[s] = None
        self._slot_used[s] = next(self._tick)
        g = row.group
        if all(r.finished for r in g.rows):
            g.completions = [self._completion(r) for r in g.rows]

    def _completion(self, row) -> Completion:
        return Completion(
            request_id=row.rid, sample_index=row.sample, tokens=list(row.tokens),
            logprobs=np.asarray(row.lps, np.float32), raw_logprobs=np.asarray(row.raws, np.float32),
            versions=np.asarray(row.versions, np.int32), expert_ids=row.expert_ids, finish_reason=row.reason,
            prompt_len=row.prompt_len, prefilled=row.group.prefilled, slot=row.slot)

    def run_until_done(self, rid: int | None = None, max_chunks: int | None = None) -> None:
        """Step until every request (or request `rid`) is finished."""
        k = 0
        while self.pending() and (rid is None or not self.done(rid)):
            self.step_chunk()
            k += 1
            if max_chunks is not None and k >= max_chunks:
                return


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


def _cat(xs):
    return xs[0] if len(xs) == 1 else np.concatenate(xs, 0)
