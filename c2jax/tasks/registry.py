"""The task-suite registry: `load_suite(name, split, n, seed, **kw)` over registered loaders.

The built-in suites are registered here, each loader importing its source module when first
used; c2jax.tasks re-exports everything below. See c2jax.tasks for the suites and their splits.
Suites from outside the package load by name too: "package.module:loader" imports the loader,
and a distribution may declare one under the entry-point group "c2jax.task_suites" (name =
the suite name). See c2jax/tasks/README.md.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

from c2jax.tasks.base import Task, lines_changed

SPLITS = ("train", "heldout")
ENTRY_POINT_GROUP = "c2jax.task_suites"
_SUITES: dict[str, Callable[..., list]] = {}


def register_suite(name: str, loader: Callable[..., list]) -> None:
    """Add a suite; `loader(split, n, seed, **kw)` returns a deterministic list of Tasks."""
    _SUITES[name] = loader


def _synthetic(split, n, seed, level=1):
    from c2jax.tasks import synthetic
    return synthetic.load(split, n, seed, level=int(level))


def _stdlib(split, n, seed, **kw):
    from c2jax.tasks import stdlib_bugs
    return stdlib_bugs.load(split, n, seed, **kw)


def _humaneval(split, n, seed):
    from c2jax.tasks import humaneval
    return humaneval.load(split, n, seed)


def _behaviour(split, n, seed, **kw):
    from c2jax.tasks import behaviour
    return behaviour.load(split, n, seed, **kw)


def _long_horizon(split, n, seed, **kw):
    from c2jax.tasks import long_horizon
    return long_horizon.load(split, n, seed, **kw)


def _long_horizon_small(split, n, seed, **kw):
    from c2jax.tasks import long_horizon
    return long_horizon.load(split, n, seed, **{**long_horizon.SMALL, **kw})


register_suite("synthetic", _synthetic)
register_suite("stdlib_bugs", _stdlib)
register_suite("humaneval", _humaneval)
register_suite("behaviour", _behaviour)
register_suite("long_horizon", _long_horizon)
register_suite("long_horizon_small", _long_horizon_small)


def _entry_points() -> dict:
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_suites() -> list[str]:
    """Names of the registered and entry-point suites, sorted."""
    return sorted(set(_SUITES) | set(_entry_points()))


def _outside_loader(name: str) -> Callable[..., list] | None:
    """The loader of an entry-point suite or of a "package.module:loader" name, else None."""
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    mod_name, sep, attr = name.partition(":")
    if not sep or not attr or mod_name in _SUITES:
        return None
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"task suite {name!r}: cannot import module {mod_name!r} ({e}); "
                         "put its directory on PYTHONPATH") from None
    loader = getattr(mod, attr, None)
    if not callable(loader):
        raise ValueError(f"task suite {name!r}: {mod_name!r} has no loader function {attr!r}")
    return loader


def _check_loaded(name: str, tasks, split: str, n: int | None) -> list[Task]:
    if not isinstance(tasks, (list, tuple)):
        raise TypeError(f"task suite {name!r}: the loader returned {type(tasks).__name__}, not a list of Tasks")
    bad = [t for t in tasks if not callable(getattr(t, "grade", None)) or not hasattr(t, "task_id")]
    if bad:
        raise TypeError(f"task suite {name!r}: the loader returned non-tasks, e.g. {bad[0]!r:.200}")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"task suite {name!r}: duplicate task ids {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    tasks = [t for t in tasks if getattr(t, "split", split) == split]
    return tasks if n is None else tasks[:n]


def load_suite(name: str, split: str, n: int | None = None, seed: int = 0, **kw) -> list[Task]:
    """Tasks of suite `name` ("synthetic:2" sets level=2) in `split`; first n; seeded order.

    Default sizes when n is None: synthetic 100, stdlib_bugs 20, humaneval all of the split,
    behaviour 40.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    outside = _outside_loader(name)
    if outside is not None:
        return _check_loaded(name, outside(split, n, seed, **kw), split, n)
    base, _, arg = name.partition(":")
    if base not in _SUITES:
        raise ValueError(f"unknown task suite {name!r}; available: {', '.join(available_suites())}, "
                         "or 'package.module:loader' for a suite outside this package")
    if arg:
        if base != "synthetic":
            raise ValueError(f"suite {base!r} takes no ':' argument (got {name!r})")
        kw["level"] = int(arg)
    return _SUITES[base](split, n, seed, **kw)


def suite_stats(tasks: list[Task]) -> dict:
    """Median prompt length (chars) and median lines changed by the reference, per suite."""
    import statistics
    by: dict[str, list[Task]] = {}
    for t in tasks:
        by.setdefault(t.suite, []).append(t)
    out = {}
    for suite, ts in sorted(by.items()):
        out[suite] = {"n": len(ts),
                      "median_prompt_chars": statistics.median(len(t.prompt) for t in ts),
                      "median_lines_changed": statistics.median(lines_changed(t) for t in ts)}
    return out
