"""The pretraining / context-extension / SFT loop: data, model init (random, run checkpoint or
HF import), jitted sharded step, evals, checkpoints with exact resume, metrics."""
from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from c2jax import hf
from c2jax.atomic_write import write_text_atomic
from c2jax.data.codebase import codebase_eval_arrays, iter_batches
from c2jax.data.pipeline import load_corpus_and_tokenizer, make_sft_iterator, make_train_iterator
from c2jax.data.tokenizer import Tokenizer
from c2jax.models import init_params, param_count
from c2jax.models import param_shardings
from c2jax.ops.target import target_of_mesh
from c2jax.parallel import activate, data_sharding, make_mesh
from c2jax.parallel.distributed import global_batch
from c2jax.progress import Heartbeat
from c2jax.runlock import workdir_lock
from c2jax.train.checkpoint import Checkpointer, StopFlag, abstract_like
from c2jax.train.compat import (OPTIMIZER_FIELDS, check_init_from, check_workdir,  # noqa: F401 (re-exported)
                                saved_differences)
from c2jax.train.run_config import load_run_config  # noqa: F401 (re-exported: callers import it from here)
from c2jax.train.metrics import MetricsWriter, Progress, measured_matmul_peak
from c2jax.train.optimizer import learning_rate_schedule, make_optimizer
from c2jax.train.step import (BATCH_KEYS, init_sharded_state, make_eval_step, make_train_step,
                              train_flops_per_token)

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the last good checkpoint is kept."""


def _save_config(cfg, workdir):
    write_text_atomic(os.path.join(workdir, "config.json"), cfg.to_json_best_effort(indent=2))


def _is_hf_dir(path):
    return os.path.exists(os.path.join(path, "config.json")) and (
        os.path.exists(os.path.join(path, "model.safetensors"))
        or os.path.exists(os.path.join(path, "model.safetensors.index.json")))


def load_run_params(run_dir: str, cfg, shardings=None, purpose: str = "train.init_from"):
    """Params of the newest intact checkpoint of a c2jax run directory, checked leaf for leaf
    (shape, dtype) against cfg's model: CheckpointMismatch names the leaves that differ."""
    ckdir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not os.path.isdir(ckdir):
        raise FileNotFoundError(f"{run_dir}: not a c2jax run directory (no checkpoints/ in it)")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    shapes = abstract_like(shapes, shardings)
    hint = (f"Its config.json does not describe its checkpoints; fix {os.path.join(run_dir, 'config.json')}"
            if purpose == "convert" else "Set the model config to the one that run was trained with")
    ckpt = Checkpointer(ckdir, every=1, keep=1000, async_save=False, create=False)
    try:
        step, params = ckpt.restore_intact(lambda s: ckpt.restore_params(s, shapes, hint=hint))
    finally:
        ckpt.close()
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoints to start from")
    return params


def initial_params(cfg, shardings, random_only: bool = False):
    """Random init, a previous run's latest checkpoint, or an HF import (train.init_from).
    `random_only`: a resumed run, whose restore replaces every param anyway."""
    src = cfg.train.init_from
    if not src or random_only:
        init = jax.jit(lambda k: init_params(cfg, k), out_shardings=shardings)
        return init(jax.random.key(cfg.seed))
    if _is_hf_dir(src):
        m, params = hf.load(src, shardings=shardings, dtype=cfg.model.param_dtype)
        return params
    return load_run_params(src, cfg, shardings, purpose="train.init_from")


def _tokenizer_for(cfg, workdir):
    """Reuse the tokenizer of init_from's run so token ids keep their meaning across stages."""
    src = cfg.train.init_from
    if src and os.path.exists(os.path.join(src, "tokenizer.json")) and not os.path.exists(
            os.path.join(workdir, "tokenizer.json")):
        shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(workdir, "tokenizer.json"))


def _weighted_nll(eval_step, params, batches, dsh) -> tuple[float, float]:
    """Sum of NLL and of weights over batches, accumulated on device (one host sync at the end)."""
    nll = w = jnp.zeros((), jnp.float32)
    for batch in batches:
        r = eval_step(params, {k: jax.device_put(batch[k], dsh) for k in BATCH_KEYS})
        nll, w = nll + r["nll_sum"], w + r["weight"]
    return float(nll), float(w)


def evaluate(cfg, params, tokenizer, corpus, codebase_arrays, eval_step, dsh, batch_size, seq_len) -> dict:
    """Held-out loss (corpus held-out split) and codebase perplexity (rolling windows over
    `codebase_arrays`, tokenized once per run by c2jax.data.codebase.codebase_eval_arrays)."""
    out = {}
    heldout = []
    if corpus.heldout:
        heldout = make_train_iterator(cfg.data, tokenizer, seq_len, batch_size, cfg.seed, split="heldout",
                                      num_epochs=1, shuffle=False, corpus=corpus)
    if cfg.train.eval_batches:
        heldout = itertools.islice(heldout, cfg.train.eval_batches)
    nll, w = _weighted_nll(eval_step, params, heldout, dsh)
    if w:
        out["heldout_loss"] = nll / w
    nll, w = _weighted_nll(eval_step, params, iter_batches(codebase_arrays, batch_size), dsh)
    if w:
        out["codebase_loss"] = nll / w
        out["codebase_ppl"] = math.exp(min(nll / w, 50.0))
    return out


def run_training(cfg, workdir: str) -> dict:
    """Run (or resume) one training stage into workdir. Returns the final summary.

    The workdir is locked for the run (c2jax.runlock); on resume the config is checked against
    the run's config.json and the checkpoint's tree before anything is written, and the newest
    checkpoint that restores is used."""
    os.makedirs(workdir, exist_ok=True)
    with workdir_lock(workdir):
        return _run_training(cfg, workdir)


def _metrics_to_keep(start: int, total: int):
    """Which rows of an existing metrics.jsonl a run starting at `start` keeps: those before the
    restored step (its own rows too, except a final evaluation it will write again)."""
    def keep(row):
        step = row.get("step", 0)
        evals_only = all(k in ("step", "time") or k.startswith("eval/") for k in row)
        return step < start or (step == start and start > 0 and not (evals_only and start >= total))
    return keep


def _run_training(cfg, workdir: str) -> dict:
    t = cfg.train
    resuming = check_workdir(cfg, workdir)   # before anything is written there
    _tokenizer_for(cfg, workdir)
    corpus, tokenizer = load_corpus_and_tokenizer(cfg.data, workdir)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        from c2jax.config import ConfigError
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; raise model.vocab_size or lower data.vocab_size")
    mesh = make_mesh(cfg)
    if t.stage == "sft":   # the data is checked before any checkpoint is read
        if not cfg.data.sft_path:
            from c2jax.config import ConfigError
            raise ConfigError("train.stage='sft' needs data.sft_path (a JSONL of chats)")
        it = make_sft_iterator(cfg.data.sft_path, tokenizer, t.seq_len, t.batch_size, cfg.seed)
    else:
        it = make_train_iterator(cfg.data, tokenizer, t.seq_len, t.batch_size, cfg.seed, corpus=corpus)
    with activate(cfg, mesh):
        p_sh = param_shardings(cfg, mesh)
        dsh = data_sharding(cfg, mesh)
        params = initial_params(cfg, p_sh, random_only=resuming)
        optimizer = make_optimizer(t, target_of_mesh(mesh), params)   # train.optimizer for this mesh
        state, st_sh = init_sharded_state(cfg, optimizer, mesh, params, p_sh, cfg.seed)
        del params
        step_fn = make_train_step(cfg, optimizer, st_sh, dsh)
        eval_step = make_eval_step(cfg)
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), t.checkpoint_every, t.keep_checkpoints,
                            t.async_checkpoint)
        start = 0
        if resuming:
            target = abstract_like(state, st_sh)
            changed = saved_differences(cfg, workdir, "train", OPTIMIZER_FIELDS)
            hint = ((f"Changed since the run started: {', '.join(changed)}. " if changed else "")
                    + "Resume with the run's config (its config.json) or use a new --workdir")
            try:
                step, restored = ckpt.restore_intact(lambda s: ckpt.restore(s, target, hint=hint), quarantine=True)
            except BaseException:
                ckpt.close()
                raise
            if restored is not None:
                state, data_state, _ = restored
                it.set_state(data_state["iterator"])
                start = int(state["step"])
                log.info("resumed from step %d", start)
        _save_config(cfg, workdir)
        writer = MetricsWriter(workdir, keep=_metrics_to_keep(start, t.steps))
        stop = StopFlag().install()
        # A line every 10 s while nothing else prints (compiling, evaluating, slow steps).
        beat = Heartbeat(t.stage, t.steps, every=10.0 if jax.process_index() == 0 else 1e9, start=start)
        beat.__enter__()
        try:
            peak = t.peak_flops or measured_matmul_peak()
            fpt = train_flops_per_token(cfg, t.seq_len)
            progress = Progress(t.steps, start)
            bad_in_a_row, tokens_since, t_since = 0, 0.0, None
            summary = {"params": param_count(cfg), "start_step": start}
            codebase = codebase_eval_arrays(cfg.data, tokenizer, window=t.seq_len)
            run_eval = functools.partial(evaluate, cfg, tokenizer=tokenizer, corpus=corpus, codebase_arrays=codebase,
                                         eval_step=eval_step, dsh=dsh, batch_size=t.batch_size, seq_len=t.seq_len)
            lr_at = learning_rate_schedule(t)

            def next_batch():
                # This process's rows -> global arrays; zigzag-reordered when CP > 1.
                rows = next(it)
                return global_batch(cfg, mesh, {k: np.asarray(rows[k]) for k in BATCH_KEYS}, t.batch_size)

            if start == 0:
                beat.note = "evaluating (held-out loss, codebase perplexity)"
                first = run_eval(state["params"])
                writer.write(0, {f"eval/{k}": v for k, v in first.items()})
                summary["initial_eval"] = first
            step = start
            batch = next_batch() if step < t.steps else None
            data_state = it.get_state()
            beat.note = "first step (compiling)" if step < t.steps else ""
            while step < t.steps:
                state, metrics = step_fn(state, batch)
                step += 1
                beat.done, beat.note = step, ""
                data_state = it.get_state()  # the position after the batch just trained on
                # Build the next batch while the device runs this step, then sync on its metrics.
                batch = next_batch() if step < t.steps else None
                metrics = jax.device_get(metrics)
                if t_since is None:
                    t_since = time.time()  # the first step includes compilation
                    progress = Progress(t.steps, step)  # so the ETA counts from the steps after it
                else:
                    tokens_since += t.batch_size * t.seq_len
                bad_in_a_row = bad_in_a_row + 1 if metrics["skipped"] else 0
                if bad_in_a_row >= t.max_bad_steps:
                    ckpt.wait()
                    raise TrainingDiverged(
                        f"{bad_in_a_row} non-finite steps in a row at step {step}; the last good checkpoint "
                        f"is step {ckpt.latest_step()} in {ckpt.directory}. Lower train.lr or check the data.")
                if step % t.log_every == 0 or step == t.steps:
                    elapsed = time.time() - t_since
                    tps = tokens_since / elapsed if elapsed > 0 and tokens_since else 0.0
                    metrics.update(tokens_per_s=tps, mfu=tps * fpt / peak if tps else 0.0,
                                   lr=float(lr_at(step)))
                    writer.write(step, metrics)
                    progress.update(step, loss=float(metrics["loss"]), tok_s=round(tps))
                    beat.touch()
                if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                    beat.note = "evaluating (held-out loss, codebase perplexity)"
                    ev = run_eval(state["params"])
                    beat.note = ""
                    writer.write(step, {f"eval/{k}": v for k, v in ev.items()})
                if not metrics["skipped"]:
                    ckpt.save(step, state, {"iterator": data_state}, {"step": step})
                if stop:
                    log.warning("SIGTERM: saving step %d and exiting", step)
                    ckpt.save(step, state, {"iterator": data_state}, {"step": step}, force=True)
                    break
            beat.note = "final evaluation (held-out loss, codebase perplexity)"
            final = run_eval(state["params"])
            writer.write(step, {f"eval/{k}": v for k, v in final.items()})
            summary.update(final_eval=final, final_step=step, stopped_early=bool(stop))
            if step == t.steps and ckpt.latest_step() != step:
                ckpt.save(step, state, {"iterator": data_state}, {"step": step}, force=True)
        finally:
            beat.__exit__()
            ckpt.close()
            writer.close()
            stop.restore()
    write_text_atomic(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=2))
    return summary


__all__ = ["run_training", "TrainingDiverged", "load_run_params", "check_init_from", "evaluate", "Tokenizer"]
