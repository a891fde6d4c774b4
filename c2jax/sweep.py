"""Sweeps: expand a grid of config overrides, run each point, collect one results table.

A sweep is a config file `configs/sweeps/NAME.py` whose `get_config()` returns a ConfigDict:

    base     "configs/rl_small.py" or "configs/rl_small.py:arg"   base config of every point
    command  "pretrain" | "sft" | "rl" | ...                        `python -m c2jax <command>`
             or a script "experiments/NAME.py" taking the same flags    `python <script>`
    grid     cartesian product of override values, either as pairs (keeps the order)
               [("model.num_experts", [8, 16]), ("rl.kl_coef", [0.0, 1e-3])]
             or nested dicts (ConfigDict rejects dots in keys; keys are then sorted)
               {"model": {"num_experts": [8, 16]}}
    points   alternatively, a list of override dicts [{"model.num_experts": 8}, ...]
    metrics  keys to collect into the table, e.g. ["eval/accuracy", "train/loss"]
    seeds    optional list; every point runs once per seed (override key `seed_key`, "seed")

Each point runs in `workdir/<point name>/` (names like `model.num_experts=16,seed=1`), gets
`point.json` (its overrides) before it starts and a `DONE` marker after it succeeds; points
with `DONE` are skipped, so a sweep can be restarted. A failing point gets a `FAILED` file
with the error and does not stop the others. `collect` reads each point's `results.json`
(a summary dict, preferred) or the last value of each key in `metrics.jsonl`.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Runner = Callable[[str, str, dict, str], Any]

DONE = "DONE"
FAILED = "FAILED"
POINT_FILE = "point.json"
_MAX_NAME = 200


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    overrides: dict


@dataclasses.dataclass
class PointResult:
    name: str
    status: str  # "done" | "skipped" | "failed" | "dry_run"
    error: str = ""


# ----------------------------------------------------------------------------- loading

def load_sweep(path: str):
    """Import `path[:arg]` and return its get_config(arg) (or get_config())."""
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import call_config_file
    return call_config_file(path)


# ----------------------------------------------------------------------------- expansion

def _get(cfg, key, default=None):
    try:
        value = cfg[key] if isinstance(cfg, Mapping) else getattr(cfg, key)
    except (KeyError, AttributeError):
        return default
    return default if value is None else value


def _to_plain(x):
    """ConfigDict / FrozenConfigDict -> dict, recursively; other values unchanged."""
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if isinstance(x, Mapping):
        return {k: _to_plain(v) for k, v in x.items()}
    return x


def _flatten_grid(grid) -> list[tuple[str, list]]:
    if isinstance(grid, (list, tuple)):
        pairs = []
        for item in grid:
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise ValueError(f"sweep.grid as a list must hold (key, values) pairs, got {item!r}")
            pairs.append((str(item[0]), list(item[1])))
        return pairs
    grid = _to_plain(grid)
    if not isinstance(grid, Mapping):
        raise TypeError(f"sweep.grid must be a list of (key, values) pairs or a dict, got {type(grid)}")
    pairs = []

    def walk(prefix, node):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, Mapping):
                walk(key + ".", v)
            elif isinstance(v, (list, tuple)):
                pairs.append((key, list(v)))
            else:
                raise TypeError(f"sweep.grid[{key!r}] must be a list of values, got {v!r}")

    walk("", grid)
    return pairs


def format_value(v) -> str:
    """How a value is written on the command line and in point names."""
    return v if isinstance(v, str) else repr(v)  # repr keeps 1.0 a float, True a bool


def point_name(overrides: Mapping[str, Any]) -> str:
    """`k1=v1,k2=v2` in override order; unsafe characters replaced; long names shortened
    with a hash so they stay unique and fit a file name."""
    name = ",".join(f"{k}={format_value(v)}" for k, v in overrides.items()) or "base"
    name = "".join(c if (c.isalnum() or c in "=,.-_+") else "_" for c in name)
    if len(name) > _MAX_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:_MAX_NAME - 11]}~{digest}"
    return name


def expand(sweep_cfg) -> list[Point]:
    """All points of a sweep, in a stable order (grid order, seeds innermost)."""
    grid = _get(sweep_cfg, "grid")
    points = _get(sweep_cfg, "points")
    if grid and points:
        raise ValueError("a sweep sets either `grid` or `points`, not both")
    if points:
        base_list = [dict(_to_plain(p)) for p in points]
    elif grid:
        pairs = _flatten_grid(grid)
        for k, vals in pairs:
            if not vals:
                raise ValueError(f"sweep.grid[{k!r}] is empty")
        keys = [k for k, _ in pairs]
        base_list = [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in pairs))]
    else:
        base_list = [{}]
    seeds = list(_get(sweep_cfg, "seeds", []) or [])
    seed_key = _get(sweep_cfg, "seed_key", "seed")
    out: list[Point] = []
    for ov in base_list:
        for s in (seeds or [None]):
            full = dict(ov)
            if s is not None:
                full[seed_key] = s
            out.append(Point(point_name(full), full))
    names = [p.name for p in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"sweep points have duplicate names {sorted(dup)}; make the overrides distinct")
    return out


# ----------------------------------------------------------------------------- running

def build_command(command: str, base_config: str, overrides: Mapping[str, Any], run_dir: str,
                  python: str = "python") -> list[str]:
    """argv of `python -m c2jax <command> --config <base> --config.<k>=<v> ... --workdir <dir>`.

    A command ending in `.py` is a script (path relative to the working directory, e.g.
    "experiments/rl_toy.py") that takes the same flags: `python <script> --config <base> ...`."""
    if command.endswith(".py"):
        argv = [python, command, "--config", base_config]
    else:
        argv = [python, "-m", "c2jax", command, "--config", base_config]
    argv += [f"--config.{k}={format_value(v)}" for k, v in overrides.items()]
    argv += ["--workdir", run_dir]
    return argv


def default_runner(command: str, base_config: str, overrides: dict, run_dir: str) -> int:
    """Run one point as a subprocess of this Python; output goes to run_dir/log.txt."""
    argv = build_command(command, base_config, overrides, run_dir, python=sys.executable)
    with open(os.path.join(run_dir, "log.txt"), "ab") as log:
        return subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write_point_file(run_dir: str, point: Point, command: str, base: str) -> None:
    """run_dir/point.json (creating run_dir): what `collect` reads to list a point."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, POINT_FILE), "w") as f:
        json.dump({"name": point.name, "overrides": point.overrides, "command": command, "base": base,
                   "started": _now()}, f, indent=1, default=repr)


def run_sweep(sweep_cfg, workdir: str, runner: Runner | None = None, dry_run: bool = False,
              log: Callable[[str], None] = print) -> list[PointResult]:
    """Run the points one after another into workdir/<name>/.

    `runner(command, base_config, overrides, run_dir)` runs one point; it fails by raising or
    by returning a nonzero int (the default runner returns the subprocess exit code).
    Points with a DONE marker are skipped. A failure writes run_dir/FAILED and the sweep goes
    on. Writes workdir/sweep_status.json after every point and, when the sweep names
    `metrics`, workdir/results.{md,csv} at the end. Returns one result per point.
    """
    runner = runner or default_runner
    command = _get(sweep_cfg, "command")
    base = _get(sweep_cfg, "base")
    if not command or not base:
        raise ValueError("a sweep config needs `command` (e.g. 'rl') and `base` (a config path)")
    points = expand(sweep_cfg)
    results: list[PointResult] = []
    if not dry_run:
        os.makedirs(workdir, exist_ok=True)
    for i, p in enumerate(points):
        run_dir = os.path.join(workdir, p.name)
        if os.path.exists(os.path.join(run_dir, DONE)):
            results.append(PointResult(p.name, "skipped"))
            log(f"[sweep {i + 1}/{len(points)}] {p.name}: done before, skipped")
            continue
        if dry_run:
            results.append(PointResult(p.name, "dry_run"))
            log(shlex.join(build_command(command, base, p.overrides, run_dir)))
            continue
        write_point_file(run_dir, p, command, base)
        failed_path = os.path.join(run_dir, FAILED)
        if os.path.exists(failed_path):
            os.remove(failed_path)
        log(f"[sweep {i + 1}/{len(points)}] {p.name}: running")
        try:
            rc = runner(command, base, dict(p.overrides), run_dir)
            error = f"exit code {rc}" if isinstance(rc, int) and not isinstance(rc, bool) and rc != 0 else ""
        except Exception:  # noqa: BLE001 - one bad point must not stop the sweep
            error = traceback.format_exc()
        if error:
            with open(failed_path, "w") as f:
                f.write(f"{_now()}\n{error}\n")
            results.append(PointResult(p.name, "failed", error))
            log(f"[sweep {i + 1}/{len(points)}] {p.name}: FAILED ({error.strip().splitlines()[-1]})")
        else:
            with open(os.path.join(run_dir, DONE), "w") as f:
                f.write(_now() + "\n")
            results.append(PointResult(p.name, "done"))
        with open(os.path.join(workdir, "sweep_status.json"), "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    metrics = list(_get(sweep_cfg, "metrics", []) or [])
    if metrics and not dry_run:
        collect(workdir, metrics, points)
    return results


def launch_commands(sweep_cfg, workdir: str, path: str | None = None, python: str = "python") -> list[str]:
    """One shell line per point (skips when DONE exists, writes DONE on success), for
    dispatching points to pods by hand or by a job array. Written to `path` if given."""
    command, base = _get(sweep_cfg, "command"), _get(sweep_cfg, "base")
    if not command or not base:
        raise ValueError("a sweep config needs `command` and `base`")
    lines = []
    for p in expand(sweep_cfg):
        run_dir = os.path.join(workdir, p.name)
        d = shlex.quote(run_dir)
        cmd = shlex.join(build_command(command, base, p.overrides, run_dir, python=python))
        lines.append(f"[ -f {d}/{DONE} ] || {{ mkdir -p {d} && {cmd} > {d}/log.txt 2>&1 && date -u > {d}/{DONE}; }}")
    if path:
        with open(path, "w") as f:
            f.write("#!/usr/bin/env bash\n# one line per sweep point; lines are independent\n")
            f.write("\n".join(lines) + "\n")
    return lines


# ----------------------------------------------------------------------------- collection

@dataclasses.dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]]

    def to_markdown(self) -> str:
        def cell(v):
            if v is None:
                return ""
            if isinstance(v, float):
                return f"{v:.6g}"
            return str(v).replace("|", "\\|")
        out = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(out) + "\n"

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(self.columns)
        w.writerows([["" if v is None else v for v in row] for row in self.rows])
        return buf.getvalue()


def _lookup(d: Mapping, key: str):
    if key in d:
        return d[key]
    node: Any = d
    for part in re.split(r"[./]", key):  # "eval/accuracy" also finds {"eval": {"accuracy": ..}}
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _last_values(metrics_path: str) -> dict:
    """Last value of every key over the lines of a metrics.jsonl (bad lines are skipped:
    a run killed mid-write leaves a partial last line)."""
    last: dict = {}
    with open(metrics_path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                last.update(rec)
    return last


def read_point_metrics(run_dir: str, metrics: Sequence[str]) -> dict:
    """metric -> value from results.json (preferred) or the last metrics.jsonl value."""
    summary, last = {}, {}
    rpath, mpath = os.path.join(run_dir, "results.json"), os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(rpath):
        try:
            with open(rpath) as f:
                summary = json.load(f)
        except json.JSONDecodeError:
            summary = {}
    if os.path.exists(mpath):
        last = _last_values(mpath)
    out = {}
    for m in metrics:
        v = _lookup(summary, m)
        out[m] = v if v is not None else _lookup(last, m)
    return out


def _status(run_dir: str) -> str:
    if os.path.exists(os.path.join(run_dir, DONE)):
        return "done"
    if os.path.exists(os.path.join(run_dir, FAILED)):
        return "failed"
    return "incomplete" if os.path.isdir(run_dir) else "missing"


def collect(workdir: str, metrics: Iterable[str], points: Sequence[Point] | None = None,
            write: bool = True) -> Table:
    """One row per point: name, override values, status, metrics. Points default to every
    run dir under workdir with a point.json (sorted). Writes workdir/results.{md,csv}."""
    metrics = list(metrics)
    if points is None:
        points = []
        for name in sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []:
            pfile = os.path.join(workdir, name, POINT_FILE)
            if os.path.exists(pfile):
                with open(pfile) as f:
                    points.append(Point(name, json.load(f).get("overrides", {})))
    keys: list[str] = []
    for p in points:
        keys += [k for k in p.overrides if k not in keys]
    rows = []
    for p in points:
        run_dir = os.path.join(workdir, p.name)
        vals = read_point_metrics(run_dir, metrics) if os.path.isdir(run_dir) else dict.fromkeys(metrics)
        vals = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in vals.items()}
        rows.append([p.name] + [p.overrides.get(k) for k in keys] + [_status(run_dir)]
                    + [vals[m] for m in metrics])
    table = Table(["point"] + keys + ["status"] + metrics, rows)
    if write:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "results.md"), "w") as f:
            f.write(table.to_markdown())
        with open(os.path.join(workdir, "results.csv"), "w", newline="") as f:
            f.write(table.to_csv())
    return table
