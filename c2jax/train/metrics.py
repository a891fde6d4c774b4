"""Run observability: metrics.jsonl, TensorBoard event files, a progress line with ETA, and
the machine's measured matmul peak for MFU."""
from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


class MetricsWriter:
    """Append-only metrics.jsonl plus TensorBoard scalars/histograms in the run directory."""

    def __init__(self, workdir: str, tensorboard: bool = True, keep=None):
        """`keep(row) -> bool`: which rows of an existing metrics.jsonl stay (a resumed run drops
        those past its restored step, which it writes again); None keeps them all."""
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        if keep is not None and jax.process_index() == 0:
            filter_rows(self.path, keep)
        self._f = open(self.path, "a")
        self._tb = None
        if tensorboard and jax.process_index() == 0:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: dict):
        row = {"step": int(step), "time": time.time()}
        for k, v in metrics.items():
            arr = np.asarray(v)
            row[k] = arr.tolist() if arr.ndim else float(arr) if arr.dtype.kind == "f" else int(arr)
        if jax.process_index() == 0:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
            if self._tb is not None:
                for k, v in row.items():
                    if k in ("step", "time"):
                        continue
                    if isinstance(v, list):
                        self._tb.add_histogram(k, np.asarray(v, np.float64).ravel(), step)
                    else:
                        self._tb.add_scalar(k, v, step)

    def close(self):
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def filter_rows(path: str, keep) -> int:
    """Rewrite a JSONL file with only the rows `keep` accepts (atomically: a temporary file then
    a rename; a torn last line is dropped). Returns the number of rows dropped."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if keep(row):
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return dropped


def read_metrics(workdir: str) -> list[dict]:
    """All rows of a run's metrics.jsonl."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """One status line per log step: step, loss, tokens/s, ETA."""

    def __init__(self, total: int, start: int = 0, stream=None):   # None: sys.stderr when printing
        self.total, self.start, self.t0, self.stream = total, start, time.time(), stream

    def update(self, step: int, **values):
        done = step - self.start
        elapsed = time.time() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        parts = [f"step {step}/{self.total}"] + [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in values.items()]
        parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        if jax.process_index() == 0:
            print(" | ".join(parts), file=self.stream or sys.stderr, flush=True)


@functools.lru_cache(maxsize=None)
def _square_product(n: int, dtype_name: str):
    """The compiled n x n @ n x n product and its operand, made once per (n, dtype): samples
    taken between training steps must not pay a compile each."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype_name))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return f, a


def measured_matmul_peak(n: int = 1024, repeats: int = 5, dtype=jnp.float32) -> float:
    """FLOP/s of an n x n x n XLA matmul on the default device (best of `repeats`)."""
    f, a = _square_product(n, jnp.dtype(dtype).name)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best
