"""`python -m c2jax convert`: HF checkpoint directory <-> c2jax run directory (orbax).

    python -m c2jax convert --from hf HF_DIR --to RUN_DIR            # start a run: train.init_from=RUN_DIR
    python -m c2jax convert --from orbax RUN_DIR --to HF_DIR [--quantize fp8|int4] [--dtype bfloat16]

An HF import writes RUN_DIR/config.json (c2jax's defaults with the checkpoint's model config) and
the params as orbax step 0 under RUN_DIR/checkpoints, the layout c2jax.train.loop.load_run_params
reads. An export writes the run's latest params as an HF checkpoint (plain, fp8 blocks or int4
experts; c2jax.hf.save).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from c2jax.hf.errors import CheckpointError


class Progress:
    """A one-line text progress bar on stderr (total may be unknown)."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream, self.start = label, stream or sys.stderr, time.time()

    def __call__(self, done: int, total: int | None) -> None:
        secs = time.time() - self.start
        if total:
            filled = int(30 * done / total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}"
        else:
            bar = f"{done} tensors"
        self.stream.write(f"\r{self.label} {bar} {secs:.1f}s")
        if total and done == total:
            self.stream.write("\n")
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()


def hf_to_orbax(src: str, dst: str, dtype: str | None = None, mtp: bool | None = None) -> dict:
    """Import an HF checkpoint into a c2jax run directory; returns a summary."""
    import c2jax.sections  # noqa: F401  (the data / eval / rl config sections)
    from c2jax import hf
    from c2jax.config import default_config
    from c2jax.train.checkpoint import Checkpointer
    if os.path.exists(os.path.join(dst, "checkpoints")):
        raise CheckpointError(f"{dst} already holds checkpoints; convert into a new directory")
    stats = {}
    m, params = hf.load(src, dtype=dtype, mtp=mtp, stats=stats, progress=Progress("load"))
    cfg = default_config()
    cfg.model = m
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(cfg.to_json_best_effort(indent=2))
    ckpt = Checkpointer(os.path.join(dst, "checkpoints"), every=1, keep=1, async_save=False)
    ckpt.save(0, {"params": params}, meta={"converted_from": os.path.abspath(src)}, force=True)
    ckpt.close()
    if os.path.exists(os.path.join(src, "tokenizer.json")):
        shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(dst, "hf_tokenizer.json"))
    return {"from": src, "to": dst, "model_type": m.name, "quant": stats["quant"], "mtp_layers": m.num_mtp_layers,
            "skipped": stats["skipped"], "unused": len(stats["unused"]), "bytes_read": stats["bytes_read"]}


def orbax_to_hf(src: str, dst: str, quantize: str = "none", dtype: str | None = None) -> dict:
    """Export a c2jax run directory's latest params as an HF checkpoint; returns a summary."""
    from c2jax import hf
    from c2jax.train.loop import load_run_config, load_run_params
    if not os.path.exists(os.path.join(src, "config.json")):
        raise CheckpointError(f"{src}: not a c2jax run directory (no config.json)")
    cfg = load_run_config(src)
    params = load_run_params(src, cfg, purpose="convert")
    bar = Progress("save")
    try:
        hf.save(cfg.model, params, dst, quantize=quantize, dtype=dtype, progress=bar)
    finally:
        bar.close()   # an error then starts on a line of its own
    return {"from": src, "to": dst, "quantize": quantize,
            "files": sorted(f for f in os.listdir(dst) if f.endswith((".safetensors", ".json")))}


def main(argv) -> int:
    """Entry point of `python -m c2jax convert`."""
    ap = argparse.ArgumentParser(prog="python -m c2jax convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src_kind", choices=("hf", "orbax"), required=True)
    ap.add_argument("src", help="the directory to read (HF checkpoint or c2jax run)")
    ap.add_argument("--to", dest="dst", required=True, help="the directory to write")
    ap.add_argument("--quantize", choices=("none", "fp8", "int4"), default="none", help="export format")
    ap.add_argument("--dtype", default=None, help="param dtype on import; unquantized tensors' dtype on export")
    ap.add_argument("--no-mtp", action="store_true", help="import: leave the checkpoint's MTP layers out")
    args = ap.parse_args(argv)
    created = not os.path.exists(args.dst)   # a failed conversion removes what it wrote there
    try:
        if args.src_kind == "hf":
            summary = hf_to_orbax(args.src, args.dst, args.dtype, mtp=False if args.no_mtp else None)
        else:
            summary = orbax_to_hf(args.src, args.dst, args.quantize, args.dtype)
    except BaseException as e:
        if created:
            shutil.rmtree(args.dst, ignore_errors=True)
        if isinstance(e, (CheckpointError, FileNotFoundError)):
            print(f"error ({type(e).__name__}): {e}", file=sys.stderr)
            return 2
        raise   # the CLI prints user errors (a full disk, a mismatch) in one line
    print(json.dumps(summary, indent=2))
    return 0
