"""Top device ops by time from a jax.profiler trace, so the next GPU change is picked from a measurement.

    python3 experiments/bench/gpu/profile_summary.py TRACE_DIR [--top 20]

Reads the newest *.xplane.pb under TRACE_DIR with jax.profiler.ProfileData. On GPU the op events
are the device planes' "XLA Ops" lines (kernel names on the stream lines when that line is absent);
elsewhere (the CPU smoke test) the host's XLA executor lines. Events are summed by name.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os

# host bookkeeping on the CPU executor lines, not ops
_NOT_OPS = ("ThreadpoolListener", "ThunkExecutor", "SlinkyThreadPool", "end: ")


def newest_trace(trace_dir: str) -> str:
    """The newest .xplane.pb under trace_dir (jax.profiler writes plugins/profile/<time>/<host>.xplane.pb)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    return max(files, key=os.path.getmtime)


def _op_lines(pd):
    device = [p for p in pd.planes if p.name.startswith("/device:GPU")]
    if device:
        for plane in device:
            lines = list(plane.lines)
            ops = [line for line in lines if line.name == "XLA Ops"]
            yield from ops or [line for line in lines if line.name.startswith("Stream")]
        return
    for plane in pd.planes:
        if plane.name.startswith("/host:CPU"):
            yield from (line for line in plane.lines if line.name.startswith("tf_XLAExecute"))


def top_ops(xplane_path: str, top: int = 20) -> dict:
    """{"total_ms", "ops": [{"name", "ms", "count", "share"}, ...]} of the `top` ops by summed time."""
    import jax
    pd = jax.profiler.ProfileData.from_file(xplane_path)
    ms, count = collections.Counter(), collections.Counter()
    for line in _op_lines(pd):
        for e in line.events:
            if e.name.startswith(_NOT_OPS):
                continue
            ms[e.name] += e.duration_ns / 1e6
            count[e.name] += 1
    total = sum(ms.values())
    ops = [{"name": name, "ms": round(t, 3), "count": count[name], "share": round(t / total, 4) if total else 0.0}
           for name, t in ms.most_common(top)]
    return {"trace": xplane_path, "total_ms": round(total, 3), "ops": ops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    print(json.dumps(top_ops(newest_trace(args.trace_dir), args.top), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
