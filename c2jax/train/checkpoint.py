"""Orbax checkpoints of the train state plus the data iterator position (JSON).

Async saves every K steps, keep N; a save on SIGTERM; restore onto target shardings.
A checkpoint that was being written when the process died is never the one restored:
orbax finalizes a step directory atomically.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from c2jax.errors import CheckpointMismatch, CheckpointUnreadable
from c2jax.failures import cause_chain
from c2jax.train.compat import check_tree, checkpoint_tree

log = logging.getLogger(__name__)


class Checkpointer:
    """Thin wrapper over orbax's CheckpointManager for {state, data, meta}.

    Every restore first checks the step's tree metadata against the target (c2jax.train.compat),
    so a restore is never silently partial; `restore_intact` falls back past steps that cannot
    be read (truncated or deleted files), warning with the step, the file and the cause.
    """

    def __init__(self, directory: str, every: int, keep: int, async_save: bool = True, create: bool = True):
        self.directory = os.path.abspath(directory)
        if not create and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"{self.directory}: no checkpoint directory")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=max(every, 1),
                                               enable_async_checkpointing=async_save, create=create,
                                               cleanup_tmp_directories=create)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """All finalized steps, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, step: int, state, data_state: dict | None = None, meta: dict | None = None,
             force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state or {}),
                                  meta=ocp.args.JsonSave(meta or {}))
        return self.manager.save(step, args=args, force=force)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def check(self, step: int, abstract_state, subtrees: tuple[str, ...] | None = None, hint: str = "") -> None:
        """Raise CheckpointMismatch unless step's state tree matches abstract_state leaf for leaf
        (paths, shapes, dtypes; under `subtrees` only, when given)."""
        check_tree(abstract_state, checkpoint_tree(self.step_dir(step)), f"checkpoint {self.step_dir(step)}",
                   subtrees, hint)

    def restore(self, step: int | None, abstract_state, hint: str = "") -> tuple[Any, dict, dict]:
        """Restore (state, data_state, meta); abstract_state carries target shapes/shardings and
        must match the step's tree exactly (CheckpointMismatch otherwise)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        self.check(step, abstract_state, hint=hint)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return restored["state"], restored["data"] or {}, restored["meta"] or {}

    def restore_params(self, step: int, abstract_params, hint: str = ""):
        """Only state["params"] of a step (checked against abstract_params leaf for leaf)."""
        self.check(step, {"params": abstract_params}, subtrees=("params",), hint=hint)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item={"params": abstract_params}, partial_restore=True)))
        return restored["state"]["params"]

    def restore_intact(self, restore_fn, quarantine: bool = False):
        """(step, restore_fn(step)) for the newest step that restores; (None, None) when there
        are no steps. A step that fails with anything but CheckpointMismatch is reported (step,
        file, cause) and the next older one tried; with `quarantine`, once an older step restored,
        the unreadable ones are moved to DIR.corrupt/ (kept, so that they can be moved back) and
        the run can save those steps again. CheckpointUnreadable when no step restores."""
        failures, bad = [], []
        for step in self.steps():
            try:
                result = restore_fn(step)
            except CheckpointMismatch:
                raise
            except Exception as e:  # truncated / deleted files surface as many error types
                why = describe_failure(self.step_dir(step), e)
                failures.append(f"step {step}: {why}")
                log.warning("checkpoint step %d cannot be restored (%s); trying the previous one", step, why)
                bad.append(step)
                continue
            for b in bad if quarantine else ():
                self.quarantine(b)
            if bad:
                log.warning("using checkpoint step %d instead of the unreadable step(s) %s", step, bad)
            return step, result
        if failures:
            raise CheckpointUnreadable(f"no checkpoint in {self.directory} can be restored ({'; '.join(failures)}); "
                                       f"start a new run directory, or restore the files from a backup")
        return None, None

    def quarantine(self, step: int) -> str:
        """Move an unreadable step out of the way (to DIR.corrupt/STEP-<time>); returns its new path."""
        dest = os.path.join(self.directory + ".corrupt", f"{step}-{int(time.time())}")
        if jax.process_index() == 0:   # one mover on shared storage
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(self.step_dir(step), dest)
        self.manager.reload()
        log.warning("moved the unreadable checkpoint step %d to %s", step, dest)
        return dest

    def remove_partial(self, settle_s: float = 0.0, max_s: float = 10.0) -> list[str]:
        """Delete temporary step directories left by saves that did not finish; returns their
        names. With settle_s, keep deleting until none has reappeared for settle_s seconds: after
        a failed save orbax's close does not wait for the array writes already in flight, which
        recreate their directories for a moment."""
        gone, quiet_since, t0 = set(), time.time(), time.time()
        while True:
            names = [n for n in os.listdir(self.directory) if TMP_MARK in n] if os.path.isdir(self.directory) else []
            for name in names:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                gone.add(name)
            now = time.time()
            if names:
                quiet_since = now
            if now - quiet_since >= settle_s or now - t0 >= max_s:
                return sorted(gone)
            time.sleep(0.05)

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        """Finish pending saves and close; if a save failed (e.g. the disk is full), its temporary
        files are removed and its error re-raised (the finalized steps stay as they are)."""
        error = None
        for finish in (self.manager.wait_until_finished, self.manager.close):
            try:
                finish()
            except BaseException as e:
                error = error or e
        if error is not None:
            self.remove_partial(settle_s=1.0)
            raise error


TMP_MARK = ".orbax-checkpoint-tmp"
_REQUIRED = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt", "data/metadata", "meta/metadata")


def describe_failure(step_dir: str, exc: BaseException) -> str:
    """'FILE: cause' for a step that failed to restore: the first required file that is missing
    or empty, else a path under step_dir named in the error, else the step directory."""
    root = list(cause_chain(exc))[-1]      # the innermost error is the specific one (tensorstore's)
    cause = f"{type(root).__name__}: " + (" ".join(str(root).split())[:300] or "no message")
    for rel in _REQUIRED:
        item = os.path.join(step_dir, rel.split("/")[0]) if "/" in rel else step_dir
        path = os.path.join(step_dir, rel)
        if os.path.isdir(item) and (not os.path.exists(path) or os.path.getsize(path) == 0):
            return f"{path} is {'missing' if not os.path.exists(path) else 'empty'} ({cause})"
    for e in reversed(list(cause_chain(exc))):
        m = re.search(re.escape(step_dir) + r"[^\s'\"\],]*", str(e))
        if m:
            return f"{m.group(0)}: {cause}"
    return f"{step_dir}: {cause}"


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs of a pytree (with shardings when given) as a restore target."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class StopFlag:
    """Set by SIGTERM/SIGINT so the loop saves a checkpoint and exits cleanly."""

    def __init__(self):
        self.event = threading.Event()
        self._old = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM,):
            self._old[sig] = signal.signal(sig, lambda *_: self.event.set())
        return self

    def restore(self):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def __bool__(self):
        return self.event.is_set()
