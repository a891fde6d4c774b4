"""Helpers shared by the GPU benchmark drivers in this folder (no jax / torch imports here).

The drivers reuse the CPU benchmarks' code (experiments/bench/train_step.py, sampler.py and
experiments/reference/bench_common.py) by loading those files as modules, so shapes, overrides
and measurement code stay in one place.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
BENCH = os.path.join(ROOT, "experiments", "bench")
REFERENCE = os.path.join(ROOT, "experiments", "reference")

# bf16 dense peak used for MFU: 790 TFLOP/s as measured on an H200 (the datasheet's dense figure is
# 989.5); the drivers also measure an 8192^3 bf16 matmul in the same process and report both.
H200_BF16_MEASURED = 790e12
H200_BF16_SPEC = 989.5e12


def load_module(name: str, path: str):
    """Import a script (not in a package) by path, without running its __main__ block."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def emit(row: dict, jsonl: str | None) -> None:
    """Print one JSON line and append it to jsonl (flushed at once: a later kill loses nothing)."""
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if jsonl:
        with open(jsonl, "a") as f:
            f.write(line + "\n")


def default_budget(margin_s: float = 15.0) -> float:
    """Seconds a driver may spend starting optional work: $PART_LIMIT (set by run_h200.sh to the
    part's timeout) less a margin for the last item to finish, else unlimited."""
    lim = os.environ.get("PART_LIMIT")
    return float(lim) - margin_s if lim else 1e9


class Deadline:
    """Seconds left before `budget_s` from construction; used to skip optional variants."""

    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)
