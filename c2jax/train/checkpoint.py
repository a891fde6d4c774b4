"""Orbax checkpoints of the train state plus the data iterator position (JSON).

Async saves every K steps, keep N; a save on SIGTERM; restore onto target shardings.
A checkpoint that was being written when the process died is never the one restored:
orbax finalizes a step directory atomically.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Thin wrapper over orbax's CheckpointManager for {state, data, meta}."""

    def __init__(self, directory: str, every: int, keep: int, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=max(every, 1),
                                               enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict | None = None, meta: dict | None = None,
             force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state or {}),
                                  meta=ocp.args.JsonSave(meta or {}))
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int | None, abstract_state) -> tuple[Any, dict, dict]:
        """Restore (state, data_state, meta); abstract_state carries target shapes/shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return restored["state"], restored["data"] or {}, restored["meta"] or {}

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


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
