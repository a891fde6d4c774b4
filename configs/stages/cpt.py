"""Continued pretraining at short context. Arg: a model preset in configs/ (default tiny),
e.g. `configs/stages/cpt.py:tiny:mla` or `configs/stages/cpt.py:ablation:s`."""
import os

from c2jax.config import load_config_file

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preset(arg):
    name, _, sub = (arg or "tiny").partition(":")
    return load_config_file(os.path.join(HERE, f"{name}.py") + (f":{sub}" if sub else ""))


def get_config(arg=None):
    cfg = preset(arg)
    cfg.train.stage = "cpt"
    return cfg
