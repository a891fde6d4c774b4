"""`python -m c2jax <command> --config FILE[:ARG] --workdir DIR [--config.key=value ...]`.

One entry point per job; modules below hold no argparse.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

COMMANDS = {
    "pretrain": "continued pretraining / context extension (train.stage cpt|extend)",
    "sft": "supervised fine-tuning on chat transcripts (train.stage=sft)",
    "demo": "the quick-start pipeline on the tiny model",
}


# Exceptions whose message tells the user what to do; printed without a traceback.
USER_ERRORS = {"PipelineError", "CorpusError", "CheckpointError", "TrainingDiverged", "FileNotFoundError",
               "SandboxUnavailable", "TaskError"}


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m c2jax", description="c2jax: the Composer 2 recipe in JAX")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    parser.add_argument("--config", default=None, help="config file, optionally with :arg")
    parser.add_argument("--workdir", default=None, help="run directory")
    args, rest = parser.parse_known_args(argv)
    overrides = [r for r in rest if r.startswith("--config.")]
    unknown = [r for r in rest if not r.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like --config.train.lr=1e-3)")
    return args, overrides


def main(argv=None) -> int:
    """CLI entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    from c2jax.config import ConfigError, load_config

    try:
        if args.command == "demo":
            from c2jax.pipeline import run_demo
            return run_demo(args.workdir or "runs/demo", overrides)
        spec = args.config or ("configs/stages/sft.py" if args.command == "sft" else "configs/stages/cpt.py")
        import jax
        cfg = load_config(spec, overrides, validate_devices=jax.device_count())
        workdir = args.workdir or os.path.join("runs", args.command)
        if args.command in ("pretrain", "sft"):
            if args.command == "sft":
                cfg.train.stage = "sft"
            elif cfg.train.stage == "sft":
                raise ConfigError("this config is an SFT stage; run `python -m c2jax sft`")
            from c2jax.train.loop import run_training
            summary = run_training(cfg, workdir)
            print(json.dumps(summary, indent=2, default=str))
            return 0
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # user-facing failures get one clear line, not a traceback
        if type(e).__name__ in USER_ERRORS:
            print(f"error ({type(e).__name__}): {e}", file=sys.stderr)
            return 2
        raise
    return 1
