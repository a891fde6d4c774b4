"""Every config section of the layers above c2jax.config, registered by importing its module.

c2jax.config defines model / mesh / train and a registry; data, eval and rl register themselves
when their modules are imported. Entry points import this module before they build a config:
the CLI, c2jax.pipeline, c2jax.convert, c2jax.sweep, experiment scripts and tests/conftest.py.
"""
from c2jax.data import config as data_config  # noqa: F401
from c2jax.evals import config as eval_config  # noqa: F401
from c2jax.rl import config as rl_config  # noqa: F401
