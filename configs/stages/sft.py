"""Targeted SFT on chat transcripts (loss on assistant tokens only), from a CPT/extend run
(--config.train.init_from=runs/cpt) with --config.data.sft_path=chats.jsonl. Arg: model preset."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpt import preset  # noqa: E402


def get_config(arg=None):
    cfg = preset(arg)
    cfg.train.stage = "sft"
    cfg.train.steps = max(1, cfg.train.steps // 3)
    cfg.train.lr = cfg.train.lr / 3
    cfg.train.warmup_steps = min(cfg.train.warmup_steps, 5)
    return cfg
