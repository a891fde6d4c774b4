"""The config a run directory was launched with (its config.json), as a ConfigDict."""
from __future__ import annotations

import json
import os


def load_run_config(run_dir: str):
    """The config a run was launched with (its config.json); keys added to c2jax's defaults since
    the run was launched take their default values."""
    import ml_collections

    from c2jax.config import default_config
    with open(os.path.join(run_dir, "config.json")) as f:
        d = json.load(f)
    for section, defaults in default_config().to_dict().items():
        if isinstance(defaults, dict) and isinstance(d.get(section), dict):
            d[section] = {**defaults, **d[section]}
    for key in ("axes", "shape"):
        d["mesh"][key] = tuple(d["mesh"][key])
    d["mesh"]["rules"] = tuple((r[0], tuple(r[1]) if isinstance(r[1], list) else r[1]) for r in d["mesh"]["rules"])
    return ml_collections.ConfigDict(d)
