"""What fills a compiled program's temp memory at its peak, from an XLA dump.

    XLA_FLAGS=--xla_dump_to=DIR .venv/bin/python experiments/bench/tpu_aot.py --point P --side c2jax ...
    .venv/bin/python experiments/bench/hbm_live.py DIR [--module jit_train_step] [--min-mib 1]

For each dumped module whose name contains --module, reads the TPU compiler's buffer assignment
(`*after_optimizations-buffer-assignment.txt`) and live ranges (`*-live-range.txt`) and prints:
the preallocated temp allocation's size; the buffer that reaches its top and the instruction
where it is live; every buffer of at least --min-mib live at that instruction, by offset; and the
largest sum of live temp buffers over the program (the allocation is that plus fragmentation).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re

MiB, GiB = 2 ** 20, 2 ** 30


def temp_values(buffer_assignment: str) -> tuple[int, list[tuple[str, int, int, str]]]:
    """(size, [(value name, size, offset, shape)]) of the largest preallocated temp allocation."""
    allocs, cur = {}, None
    for line in buffer_assignment.splitlines():
        m = re.match(r"allocation (\d+): size (\d+),(.*)", line)
        if m:
            cur = int(m.group(1)) if "preallocated-temp" in m.group(3) else None
            if cur is not None:
                allocs[cur] = (int(m.group(2)), [])
            continue
        m = re.match(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", line)
        if m and cur is not None:
            allocs[cur][1].append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
    if not allocs:
        raise SystemExit("no preallocated temp allocation in the buffer assignment")
    return max(allocs.values(), key=lambda a: a[0])


def live_ranges(live_range: str) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """({buffer name: (first, last) instruction}, instruction sequence) of the live-range dump."""
    ranges, seq = {}, []
    for line in live_range.splitlines():
        m = re.match(r"\s+(\S+): ?(\d+)-(\d+)$", line)
        if m:
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
            continue
        m = re.match(r"\s+(\d+):(\S+)$", line)
        if m:
            seq.append(m.group(2))
    return ranges, seq


def report(prefix: str, min_mib: float) -> str:
    """The text report of one dumped module (path prefix up to `.after_optimizations`)."""
    with open(prefix + ".after_optimizations-buffer-assignment.txt") as f:
        size, values = temp_values(f.read())
    with open(prefix + ".after_optimizations-live-range.txt") as f:
        ranges, seq = live_ranges(f.read())
    live = []
    for name, n, off, shape in values:
        r = ranges.get(name) or ranges.get(name + "{}")
        if r is not None:
            live.append((name, n, off, shape, r))
    events = collections.Counter()
    for _, n, _, _, (s, e) in live:
        events[s] += n
        events[e + 1] -= n
    total, peak, at_peak = 0, 0, 0
    for t in sorted(events):
        total += events[t]
        if total > peak:
            peak, at_peak = total, t
    big = [v for v in live if v[1] >= min_mib * MiB]
    if not big:
        raise SystemExit(f"{prefix}: no live temp buffer of at least {min_mib:g} MiB; lower --min-mib")
    top = max(big, key=lambda v: v[1] + v[2])
    t = top[4][0]
    name = os.path.basename(prefix)
    lines = [f"# {name}", "",
             f"temp allocation: {size / GiB:.3f} GiB; largest sum of live temp buffers: {peak / GiB:.3f} GiB "
             f"at instruction {at_peak} ({seq[at_peak] if at_peak < len(seq) else '?'})",
             f"top of the allocation: {top[0]} ({top[1] / MiB:.1f} MiB at {top[2] / GiB:.3f} GiB, ends "
             f"{(top[1] + top[2]) / GiB:.3f} GiB), live over instructions {top[4][0]}-{top[4][1]}", "",
             f"buffers of at least {min_mib:g} MiB live at instruction {t} ({seq[t] if t < len(seq) else '?'}), by offset:", "",
             "| offset GiB | end GiB | MiB | buffer | live | shape |", "|---|---|---|---|---|---|"]
    for v_name, n, off, shape, (s, e) in sorted((v for v in big if v[4][0] <= t <= v[4][1]), key=lambda v: v[2]):
        lines.append(f"| {off / GiB:.3f} | {(off + n) / GiB:.3f} | {n / MiB:.1f} | {v_name} | {s}-{e} | `{shape}` |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump_dir")
    ap.add_argument("--module", default="jit_train_step", help="dumped modules whose name contains this")
    ap.add_argument("--min-mib", type=float, default=1.0, help="list live buffers of at least this many MiB")
    args = ap.parse_args(argv)
    suffix = ".after_optimizations-buffer-assignment.txt"
    prefixes = sorted(p[:-len(suffix)] for p in glob.glob(os.path.join(args.dump_dir, f"*{args.module}*{suffix}")))
    if not prefixes:
        raise SystemExit(f"no *{args.module}*{suffix} in {args.dump_dir} (was XLA_FLAGS=--xla_dump_to set?)")
    print("\n".join(report(p, args.min_mib) for p in prefixes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
