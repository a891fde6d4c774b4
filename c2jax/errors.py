"""Exceptions shared across layers (this module imports nothing from c2jax).

`ConfigError` lives here so that config sections defined next to their code (c2jax.rl.config,
c2jax.data.config) and c2jax.config, which assembles them, can all raise it without importing
each other. c2jax.config re-exports it.
"""


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the field and the fix."""
