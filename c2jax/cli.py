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
    "demo": "the quick-start pipeline on the tiny model (CPT -> SFT -> RL -> eval)",
    "eval": "benchmark a policy (oracle, do_nothing or a trained run's model) over task suites",
    "compile-check": "AOT-compile the train and decode steps for a TPU topology; HBM per chip",
    "rl": "asynchronous RL (Dr. GRPO, router replay, in-flight weight updates)",
    "sweep": "run or print a sweep of config overrides and collect its metrics",
    "convert": "HF checkpoint <-> c2jax run directory (orbax): convert --from hf|orbax SRC --to DST",
}


# Exceptions whose message tells the user what to do are printed as one line, without a traceback
# (c2jax.failures.one_line); --debug (or C2JAX_DEBUG=1) shows the traceback too.
from c2jax.failures import USER_ERRORS  # noqa: E402,F401


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m c2jax", description="c2jax: the Composer 2 recipe in JAX")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    parser.add_argument("--config", default=None, help="config file, optionally with :arg")
    parser.add_argument("--workdir", default=None, help="run directory")
    parser.add_argument("--topology", default=None,
                        help="compile-check: TPU topology, e.g. v5p:4x4x4 (default: the config's pod.topology)")
    parser.add_argument("--report", default=None,
                        help="compile-check: also write the report (JSON, with the date and the command) here")
    parser.add_argument("--quick", action="store_true", help="demo: a few-minute run (CI smoke)")
    parser.add_argument("--full", action="store_true",
                        help="demo: the longer run (more SFT and RL steps; about 25 minutes on 2 CPU cores)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of a user error too")
    parser.add_argument("--launch-commands", action="store_true", help="sweep: print one command per point")
    args, rest = parser.parse_known_args(argv)
    overrides = [r for r in rest if r.startswith("--config.")]
    unknown = [r for r in rest if not r.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like --config.train.lr=1e-3)")
    return args, overrides


def _eval(cfg, workdir) -> int:
    from c2jax.evals.benchmark import main_eval, render_markdown
    factory = tokenizer = None
    if cfg.eval.policy == "model":
        from c2jax.data.tokenizer import Tokenizer
        from c2jax.pipeline import batched_policy_factory
        from c2jax.train.loop import load_run_config, load_run_params
        if not cfg.eval.model_run:
            from c2jax.config import ConfigError
            raise ConfigError("eval.policy='model' needs --config.eval.model_run=RUN_DIR (a trained run)")
        run_cfg = load_run_config(cfg.eval.model_run)
        from c2jax.rl.config import SPECULATIVE_MODES
        if cfg.eval.speculative not in SPECULATIVE_MODES or (
                cfg.eval.speculative == "mtp" and not run_cfg.model.num_mtp_layers):
            from c2jax.config import ConfigError
            raise ConfigError(f"eval.speculative={cfg.eval.speculative!r}: use 'auto', 'none', or 'mtp' for a model "
                              f"with MTP heads (this run's model.num_mtp_layers={run_cfg.model.num_mtp_layers})")
        tokenizer = Tokenizer.load(cfg.eval.model_run)
        max_len = int(cfg.eval.sampler_max_len)
        cfg.eval.max_total_tokens = min(int(cfg.eval.max_total_tokens), max_len - 1)  # what the sampler can hold
        factory, service = batched_policy_factory(run_cfg, load_run_params(cfg.eval.model_run, run_cfg),
                                                  max_len=max_len, temperature=cfg.eval.temperature, seed=cfg.seed,
                                                  slots=cfg.eval.concurrency, speculative=cfg.eval.speculative)
    try:
        report = main_eval(cfg, workdir, policy_factory=factory, tokenizer=tokenizer)
    finally:
        if factory is not None:
            service.stop()
    print(render_markdown(report))
    return 0


def main(argv=None) -> int:
    """CLI entry point: a user-fixable failure prints one line and returns 2 (a traceback too with
    --debug); anything else raises."""
    from c2jax import hostmem
    # Before anything starts XLA's threads: they must allocate from the arena set up here.
    hostmem.retain_freed_memory()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("C2JAX_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    from c2jax.failures import hold_library_save_errors, one_line
    hold = None if debug else hold_library_save_errors()
    try:
        rc = _main(argv)
    except Exception as e:
        line = one_line(e)
        if line is None:
            if hold is not None:
                hold.release()
            raise
        if debug:
            import traceback
            traceback.print_exc()
        print(line, file=sys.stderr)
        return 2
    if hold is not None:
        hold.release()
    return rc


def _main(argv) -> int:
    if argv[:1] == ["convert"]:   # its own arguments (c2jax.convert)
        from c2jax.convert import main as convert_main
        return convert_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args, overrides = _parse(argv)
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax.config import ConfigError, load_config

    if args.command == "demo":
        from c2jax.pipeline import run_demo
        if args.quick and args.full:
            raise ConfigError("demo: --quick and --full are exclusive")
        mode = "quick" if args.quick else "full" if args.full else "default"
        return run_demo(args.workdir or "runs/demo", overrides, mode)
    if args.command == "sweep":
        from c2jax.sweep import collect, launch_commands, load_sweep, run_sweep
        if not args.config:
            raise ConfigError("sweep needs --config configs/sweeps/NAME.py")
        sweep = load_sweep(args.config)
        workdir = args.workdir or os.path.join("runs", "sweeps", os.path.basename(args.config).split(".")[0])
        if args.launch_commands:
            print("\n".join(launch_commands(sweep, workdir)))
            return 0
        results = run_sweep(sweep, workdir)
        print(collect(workdir, list(sweep.get("metrics", []))).to_markdown())
        return 0 if all(r.status != "failed" for r in results) else 1
    if args.command == "eval" and not args.config:
        spec = None
    else:
        spec = args.config or ("configs/stages/sft.py" if args.command == "sft" else
                               "configs/rl_tiny.py" if args.command == "rl" else "configs/stages/cpt.py")
    if args.command in ("pretrain", "sft", "rl"):   # fail at once when another run holds the workdir
        from c2jax.runlock import ensure_free
        ensure_free(args.workdir or os.path.join("runs", args.command))
    import jax
    # compile-check validates the mesh against the TPU topology, not this machine's devices; RL
    # splits them between the learner's and the sampler's meshes (c2jax.rl.roles checks both)
    devices = None if args.command in ("compile-check", "rl") else jax.device_count()
    cfg = load_config(spec, overrides, validate_devices=devices)
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
    if args.command == "eval":
        return _eval(cfg, workdir)
    if args.command == "rl":
        from c2jax.rl.loop import run_rl
        print(json.dumps(run_rl(cfg, workdir), indent=2, default=str))
        return 0
    if args.command == "compile-check":
        from c2jax.tools.compile_check import check, main as compile_report, write_report
        report = compile_report(cfg, args.topology)
        if args.report:
            write_report(report, args.report, argv if argv is not None else sys.argv[1:])
        check(cfg, args.topology, report)  # prints the report; raises ConfigError naming the fix
        return 0
    return 1
