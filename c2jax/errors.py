"""Exceptions shared across layers (this module imports nothing from c2jax).

`ConfigError` lives here so that config sections defined next to their code (c2jax.rl.config,
c2jax.data.config) and c2jax.config, which assembles them, can all raise it without importing
each other. c2jax.config re-exports it.
"""


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the field and the fix."""


class UserError(RuntimeError):
    """A failure the user can fix (a busy workdir, a checkpoint that does not match the config or
    cannot be read, an I/O error); the CLI prints its message, which names the path and the fix,
    as one line without a traceback."""


class WorkdirLocked(UserError):
    """Another live process holds the run directory's lock."""


class CheckpointMismatch(UserError):
    """A checkpoint's tree (leaf paths, shapes, dtypes) or its run's config differs from this config."""


class CheckpointUnreadable(UserError):
    """No step of a checkpoint directory can be restored (each is missing files or truncated)."""
