"""Episode throughput: N concurrent episodes vs one by one, and the sandbox's start-up cost.

    .venv/bin/python experiments/bench/episodes.py [--episodes 8] [--concurrency 8] [--model-latency-ms 0]

Each episode is a scripted agent on a synthetic task: list_dir + read_file + grep in one
parallel turn, the reference edit, `run` of the hidden-test-free smoke command, then the
final message; then grading (the hidden tests run in the sandbox). --model-latency-ms adds a
sleep per assistant message to stand in for sampler time (the overlap the harness exists for).
Prints JSON lines: sandbox start-up per command (median ms) and the concurrency ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from c2jax.agent import chat_format as cf
from c2jax.agent.policy import TextPolicy
from c2jax.agent.runner import run_episodes
from c2jax.agent.sandbox import Sandbox, SandboxLimits
from c2jax.tasks import load_suite


class BenchPolicy(TextPolicy):
    def __init__(self, task, latency_s: float):
        path = task.reference_solution[0]["arguments"]["path"]
        self.turns = [
            [{"name": "list_dir", "arguments": {"recursive": True}},
             {"name": "read_file", "arguments": {"path": path}},
             {"name": "grep", "arguments": {"pattern": "def ", "path": "."}}],
            list(task.reference_solution),
            [{"name": "run", "arguments": {"command": "python3 -c 'import sys; print(sys.version)' && ls"}}],
        ]
        self.latency_s = latency_s
        self.i = 0

    def next_message(self, context, codec):
        time.sleep(self.latency_s)
        if self.i < len(self.turns):
            self.i += 1
            return cf.render_assistant(calls=self.turns[self.i - 1])
        return cf.render_assistant("Done.")


def startup_ms(sb: Sandbox, argv: list[str], n: int = 20) -> float:
    with tempfile.TemporaryDirectory() as d:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = sb.run(argv, Path(d))
            times.append((time.perf_counter() - t0) * 1e3)
            assert r.returncode == 0, r
        return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model-latency-ms", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    sb = Sandbox(SandboxLimits(wall_s=30))
    print(json.dumps({"sandbox_startup_ms_true": round(startup_ms(sb, ["true"]), 1),
                      "sandbox_startup_ms_python": round(startup_ms(sb, ["python3", "-c", "pass"]), 1),
                      "cgroups": sb.cgroups.kind or "none"}))
    tasks = load_suite("synthetic:2", "train", a.episodes, seed=0)
    lat = a.model_latency_ms / 1e3

    def run(conc):
        t0 = time.perf_counter()
        res = run_episodes(tasks, lambda t: BenchPolicy(t, lat), sandbox=sb, concurrency=conc)
        dt = time.perf_counter() - t0
        assert all(r.grade.passed for r in res), [r.grade for r in res if not r.grade.passed][:1]
        return dt, res

    run(a.concurrency)  # warm-up (imports, page cache)
    serial, conc = [], []
    for _ in range(a.repeats):
        dt, res = run(1)
        serial.append(dt)
        conc.append(run(a.concurrency)[0])
    s, c = min(serial), min(conc)
    print(json.dumps({"episodes": a.episodes, "concurrency": a.concurrency, "model_latency_ms": a.model_latency_ms,
                      "serial_s": round(s, 3), "concurrent_s": round(c, 3), "ratio": round(s / c, 2),
                      "sandbox_commands_per_episode": 3, "tool_calls_per_episode": res[0].stats["tool_calls"]}))


if __name__ == "__main__":
    main()
