"""Where the bench's training step goes: per-operation time of the compiled step, from a
jax.profiler trace, grouped by kind (FFI kernel, XLA fusion kind, YNN product, ...).

    JAX_PLATFORMS=cpu .venv/bin/python experiments/bench/profile_step.py
    JAX_PLATFORMS=cpu .venv/bin/python experiments/bench/profile_step.py --detail c2jax_expert_ffn_bwd

The same model, batch and step as experiments/bench/train_step.py (its build_step). Times are
exclusive (a thunk's own time, less the thunks nested in it) and summed over XLA's worker threads,
per step; products XLA hands to Eigen run on Eigen's own threads and show as gaps (the step's wall
time minus the sum). FFI calls are named by their target (c2jax.backends.cpu.kernels), the rest by
their HLO name without the trailing number.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import build_step  # noqa: E402


def exclusive_times(events) -> collections.Counter:
    """{event name: exclusive microseconds} over complete ("X") trace events, per thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    excl = collections.Counter()
    for es in by_thread.values():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, child = [], collections.Counter()
        for i, e in enumerate(es):
            while stack and es[stack[-1]]["ts"] + es[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                child[stack[-1]] += e["dur"]
            stack.append(i)
        for i, e in enumerate(es):
            excl[e["name"]] += e["dur"] - child[i]
    return excl


def kind_of(name: str, targets: dict[str, str]) -> str | None:
    """The group of a thunk name: its FFI / custom-call target, or its HLO name less the number;
    None for the runtime's own events."""
    if name.startswith(("$", "end: ")) or "ThunkExecutor" in name or "ThreadPool" in name or "PjRt" in name:
        return None
    return targets.get(name, re.sub(r"\.\d+$", "", name))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (after 3 untimed ones)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--detail", default="", help="also list the operations of this kind")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from c2jax import hostmem
    hostmem.retain_freed_memory()  # host malloc first, as in train_step.py
    import jax

    cfg, mesh, compiled, state, batch, _ = build_step(args.batch, args.seq, args.set)
    targets = dict(re.findall(r"%?([\w.\-]+) = [^\n]*custom_call_target=\"([\w.\-]+)\"", compiled.as_text()))
    for _ in range(3):
        state, _m = compiled(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(args.steps):
                state, _m = compiled(state, batch)
                jax.block_until_ready(state)
        wall = (time.perf_counter() - t) / args.steps
        traces = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        if not traces:
            raise SystemExit(f"jax.profiler wrote no perfetto trace under {d}")
        with gzip.open(traces[0]) as f:
            events = json.load(f)["traceEvents"]
    kinds, ops = collections.Counter(), collections.defaultdict(collections.Counter)
    for name, us in exclusive_times(events).items():
        kind = kind_of(name, targets)
        if kind is not None:
            kinds[kind] += us / args.steps
            ops[kind][name] += us / args.steps
    total = sum(kinds.values())
    print(f"step wall {wall * 1e3:.0f} ms (profiled, {args.steps} steps); thunks {total / 1e3:.0f} ms summed over "
          f"threads; the rest ran outside XLA's thunk events (Eigen products) or between them")
    for kind, us in kinds.most_common(args.top):
        print(f"{us / 1e3:9.1f} ms  {100 * us / total:5.1f}%  {kind}  (x{len(ops[kind])})")
    if args.detail:
        print(f"\n{args.detail}:")
        for name, us in ops[args.detail].most_common(args.top):
            print(f"{us / 1e3:9.1f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
