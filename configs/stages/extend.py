"""Long-context extension: YaRN-scaled RoPE and a 4x longer sequence, from a CPT run
(set --config.train.init_from=runs/cpt). Arg: model preset as in cpt.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpt import preset  # noqa: E402


def get_config(arg=None):
    cfg = preset(arg)
    factor = 4
    cfg.train.stage = "extend"
    cfg.model.rope_scaling = "yarn"
    cfg.model.yarn_factor = float(factor)
    cfg.model.yarn_original_max_position = cfg.train.seq_len
    cfg.model.max_position_embeddings = max(cfg.model.max_position_embeddings, cfg.train.seq_len * factor)
    cfg.train.seq_len = cfg.train.seq_len * factor
    cfg.train.batch_size = max(1, cfg.train.batch_size // factor)
    cfg.train.steps = max(1, cfg.train.steps // 5)
    cfg.train.lr = cfg.train.lr / 3
    return cfg
