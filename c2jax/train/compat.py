"""Does a checkpoint fit this config? Checked before anything is restored or written.

A job calls `check_workdir(cfg, workdir)` under its workdir lock (c2jax.runlock) before it writes
anything there. The checks, each raising CheckpointMismatch with one line that names what differs:
- `check_run_config`: the model config a run directory was trained with (its config.json)
  against this one; fields that change no param shape (kernels, remat, ...) only warn.
- `check_tree`: a checkpoint's tree metadata (leaf paths, shapes, dtypes) against the tree
  this config builds (params, optimizer state), so no restore is ever silently partial.
"""
from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np

from c2jax.errors import CheckpointMismatch

log = logging.getLogger(__name__)


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_table(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """{"a/b/0/c": (shape, dtype name)} of a pytree of arrays, ShapeDtypeStructs or orbax
    ArrayMetadata; PRNG key leaves are left out (stored as their raw uint32 data)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            continue
        out["/".join(_key_name(k) for k in path)] = (tuple(leaf.shape), np.dtype(dtype).name)
    return out


def tree_differences(expected: dict, found: dict, limit: int = 4) -> list[str]:
    """Human-readable differences between two leaf tables (at most `limit`, then a count)."""
    diffs = []
    for k in sorted(set(expected) | set(found)):
        if k not in found:
            diffs.append(f"{k} missing from the checkpoint")
        elif k not in expected:
            diffs.append(f"{k} in the checkpoint but not in this config's tree")
        elif expected[k] != found[k]:
            (s1, d1), (s2, d2) = found[k], expected[k]
            diffs.append(f"{k}: {d1}{list(s1)} in the checkpoint, {d2}{list(s2)} here")
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"... {len(diffs) - limit} more"]
    return diffs


def checkpoint_tree(step_dir: str, item: str = "state"):
    """The tree metadata (ArrayMetadata leaves) of one orbax step's item, read without restoring."""
    import orbax.checkpoint as ocp
    from etils import epath
    md = ocp.StandardCheckpointHandler().metadata(epath.Path(step_dir) / item)
    return getattr(md, "item_metadata", md)


def check_tree(expected, metadata, where: str, subtrees: tuple[str, ...] | None = None, hint: str = "") -> None:
    """Raise CheckpointMismatch unless `metadata` has exactly `expected`'s leaves with the same
    shapes and dtypes (only under the top-level keys `subtrees`, when given)."""
    want, have = leaf_table(expected), leaf_table(metadata)
    if subtrees is not None:
        keep = lambda t: {k: v for k, v in t.items() if k.split("/", 1)[0] in subtrees}  # noqa: E731
        want, have = keep(want), keep(have)
    diffs = tree_differences(want, have)
    if diffs:
        raise CheckpointMismatch(f"{where} does not match this config: {'; '.join(diffs)}"
                                 + (f". {hint}" if hint else ""))


def _plain(cfg_section) -> dict:
    return json.loads(cfg_section.to_json_best_effort()) if hasattr(cfg_section, "to_json_best_effort") \
        else json.loads(json.dumps(cfg_section, default=str))


def config_differences(saved: dict, current: dict, prefix: str) -> list[str]:
    """`prefix.key: saved -> current` for each key both dicts have and that differs."""
    return [f"{prefix}.{k}={saved[k]!r} there, {current[k]!r} here" for k in sorted(set(saved) & set(current))
            if saved[k] != current[k]]


# train fields that can change the optimizer state's tree (its implementation, chain, accumulation)
OPTIMIZER_FIELDS = ("optimizer", "grad_clip", "weight_decay", "grad_accum", "b1", "b2", "adam_eps")


def saved_differences(cfg, run_dir: str, section: str, keys=None) -> list[str]:
    """`section.key=saved there, current here` for the fields of `section` (only `keys`, when
    given) where run_dir's config.json differs from cfg; [] without a readable config.json."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f).get(section, {})
    except (OSError, ValueError):
        return []
    now = _plain(cfg[section])
    if keys is not None:
        saved = {k: v for k, v in saved.items() if k in keys}
    return config_differences(saved, now, section)


def check_run_config(cfg, run_dir: str, purpose: str) -> None:
    """Compare cfg.model with the model `run_dir` was trained with (its config.json): a difference
    that changes the params' shapes or dtypes raises CheckpointMismatch naming the fields; other
    differences are logged. Reads only; writes nothing."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f).get("model", {})
    except ValueError as e:
        raise CheckpointMismatch(f"{path} is not valid JSON ({e}); restore it from a backup or use a "
                                 f"new run directory") from None
    diffs = config_differences(saved, _plain(cfg.model), "model")
    if not diffs:
        return
    from c2jax.models import init_params
    from c2jax.train.run_config import load_run_config
    then = load_run_config(run_dir)
    shapes = lambda c: leaf_table(jax.eval_shape(lambda: init_params(c, jax.random.key(0))))  # noqa: E731
    try:
        tree_diffs = tree_differences(shapes(cfg), shapes(then))
    except Exception as e:  # a saved config this version cannot build: treat it as different
        tree_diffs = [f"the saved model cannot be built ({type(e).__name__}: {e})"]
    if tree_diffs:
        fix = ("rerun with the run's model config or use a new --workdir" if purpose == "resume" else
               "set the model config to that run's (see its config.json)")
        raise CheckpointMismatch(f"{purpose}: {run_dir} was trained with a different model ({'; '.join(diffs)}), "
                                 f"so its checkpoints have other params (e.g. {tree_diffs[0]}); {fix}")
    log.warning("%s: model fields differ from %s but not the params' shapes: %s", purpose, path, "; ".join(diffs))


def _is_hf_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "config.json")) and (
        os.path.exists(os.path.join(path, "model.safetensors"))
        or os.path.exists(os.path.join(path, "model.safetensors.index.json")))


def check_init_from(cfg) -> None:
    """train.init_from names an HF checkpoint or a c2jax run whose model matches cfg's (checked
    before anything is written; FileNotFoundError or CheckpointMismatch otherwise)."""
    src = cfg.train.get("init_from") if "train" in cfg else None
    if not src or _is_hf_dir(src):
        return
    if not os.path.isdir(src):
        raise FileNotFoundError(f"train.init_from={src!r}: no such directory")
    if not os.path.isdir(os.path.join(src, "checkpoints")):
        raise FileNotFoundError(f"train.init_from={src!r} is neither a c2jax run directory (config.json and "
                                f"checkpoints/) nor an HF checkpoint (config.json and model.safetensors)")
    check_run_config(cfg, src, "train.init_from")


def has_checkpoints(workdir: str) -> bool:
    """Whether workdir/checkpoints holds a finalized orbax step (a run to resume)."""
    d = os.path.join(workdir, "checkpoints")
    return os.path.isdir(d) and any(n.isdigit() and os.path.isdir(os.path.join(d, n)) for n in os.listdir(d))


def check_workdir(cfg, workdir: str) -> bool:
    """The checks a job makes before it writes to its workdir (under c2jax.runlock.workdir_lock):
    when workdir has checkpoints, cfg's model against its config.json; else train.init_from.
    Returns whether the job resumes. Restores then go through Checkpointer.restore /
    restore_intact, which check the tree leaf for leaf."""
    if has_checkpoints(workdir):
        check_run_config(cfg, workdir, "resume")
        return True
    check_init_from(cfg)
    return False
