"""Runs lose no work: bad inputs against `python -m c2jax pretrain|sft|convert` fail in one line
before anything is written, damaged checkpoints resume from the newest intact step, a full disk
keeps the last good checkpoint, and the metrics of a resumed run have no duplicate rows."""
import errno
import json
import logging
import os
import subprocess
import sys
import time

from reliability_helpers import (STEPS, assert_same_checkpoint, cli, copy_run, losses, pretrain_args,
                                 restored_state, tree_bytes)


def _without_lock(files):
    return {k: v for k, v in files.items() if k != ".lock"}


def test_resume_with_another_shape_fails_before_writing(reference_run, corpus, tmp_path, capsys):
    run = copy_run(reference_run, tmp_path / "run")
    before = _without_lock(tree_bytes(run))
    rc, lines = cli(pretrain_args(run, corpus, extra=["--config.model.num_layers=3"]), capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (CheckpointMismatch): resume: {run} was trained with a different model "
                               "(model.num_layers=2 there, 3 here)")
    assert _without_lock(tree_bytes(run)) == before            # config.json, checkpoints, metrics untouched
    # Another optimizer state tree (no clipping: one transformation fewer in the chain).
    rc, lines = cli(pretrain_args(run, corpus, extra=["--config.train.grad_clip=0.0"]), capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (CheckpointMismatch): checkpoint {run}/checkpoints/{STEPS} does not match "
                               "this config: opt_state/")
    assert "Changed since the run started: train.grad_clip=1.0 there, 0.0 here." in lines[0]
    assert _without_lock(tree_bytes(run)) == before


def test_convert_refuses_a_checkpoint_its_config_does_not_describe(reference_run, tmp_path, capsys):
    run = copy_run(reference_run, tmp_path / "run")
    cfg = json.load(open(os.path.join(run, "config.json")))
    cfg["model"]["num_layers"] = 3
    json.dump(cfg, open(os.path.join(run, "config.json"), "w"))
    out = tmp_path / "hf"
    rc, lines = cli(["convert", "--from", "orbax", run, "--to", str(out)], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (CheckpointMismatch): checkpoint {run}/checkpoints/4 does not match this "
                               "config: params/moe_layers/block/")
    assert "Its config.json does not describe its checkpoints" in lines[0]
    assert not out.exists()


def test_init_from_another_shape_and_mistyped_init_from(reference_run, corpus, tmp_path, capsys):
    run = tmp_path / "sft"
    rc, lines = cli(pretrain_args(run, corpus, extra=[f"--config.train.init_from={reference_run}",
                                                      "--config.model.num_layers=3"]), capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (CheckpointMismatch): train.init_from: {reference_run} was trained with "
                               "a different model (model.num_layers=2 there, 3 here)")
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")
    assert not (run / "config.json").exists()
    chats = tmp_path / "chats.jsonl"     # SFT from it: the same line (it used to crash inside scan)
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "x"},
                                              {"role": "assistant", "content": "y"}]}) + "\n")
    args = pretrain_args(run, corpus, extra=[f"--config.train.init_from={reference_run}",
                                             "--config.model.num_layers=3", f"--config.data.sft_path={chats}"])
    rc, sft_lines = cli(["sft", *args[1:]], capsys)
    assert rc == 2 and sft_lines == lines, sft_lines
    typo = str(tmp_path / "no_such_run")
    rc, lines = cli(pretrain_args(tmp_path / "sft2", corpus, extra=[f"--config.train.init_from={typo}"]), capsys)
    assert rc == 2 and lines == [f"error (FileNotFoundError): train.init_from={typo!r}: no such directory"]
    assert not os.path.exists(typo)


def test_truncated_newest_checkpoint_resumes_from_the_previous_step(reference_run, corpus, tmp_path, capsys,
                                                                   caplog):
    run = copy_run(reference_run, tmp_path / "run")
    step_dir = os.path.join(run, "checkpoints", str(STEPS))
    data = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
            if os.path.basename(r) == "d"]
    biggest = max(data, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    with caplog.at_level(logging.WARNING):
        rc, _ = cli(pretrain_args(run, corpus), capsys)
    assert rc == 0
    warning = next(r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage())
    assert warning.startswith(f"checkpoint step {STEPS} cannot be restored ({step_dir}")
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["start_step"] == STEPS - 1 and summary["final_step"] == STEPS
    ref, got = losses(reference_run), losses(run)               # losses() also rejects duplicate rows
    assert got == ref and sorted(got) == list(range(1, STEPS + 1))
    assert_same_checkpoint(restored_state(run, STEPS), restored_state(reference_run, STEPS))
    assert os.listdir(run + "/checkpoints.corrupt")[0].startswith(f"{STEPS}-")   # kept aside, not deleted


def test_second_launch_fails_at_once_and_the_first_run_is_untouched(reference_run, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "c2jax", *pretrain_args(run, corpus)],
                             env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    lock = run / ".lock"
    deadline = time.time() + 120
    while not (lock.exists() and lock.read_text()) and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    t = time.time()
    rc, lines = cli(pretrain_args(run, corpus), capsys)
    took = time.time() - t
    assert first.poll() is None, "the first run ended before the second launch; test is void"
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (WorkdirLocked): {run} is in use by pid {first.pid} on host ")
    assert took < 5, took
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    for step in (2, 3, 4):
        assert_same_checkpoint(restored_state(run, step), restored_state(reference_run, step))
    assert losses(run) == losses(reference_run)


def test_full_disk_keeps_the_last_checkpoint_and_removes_partial_files(reference_run, corpus, tmp_path, capsys,
                                                                     monkeypatch, caplog):
    from etils.epath import gpath
    run = tmp_path / "run"
    real = gpath.PosixGPath.write_text

    def write_text(self, *a, **k):   # the disk fills up while step 3 is being saved
        if f"{os.sep}checkpoints{os.sep}3." in str(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(gpath.PosixGPath, "write_text", write_text)
    with caplog.at_level(logging.INFO):
        rc, lines = cli(pretrain_args(run, corpus), capsys)
    monkeypatch.undo()
    # orbax's save threads log the error with tracebacks; the CLI drops those (its line says it all)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (ENOSPC) at {run}/checkpoints/3.orbax-checkpoint-tmp")
    assert lines[0].endswith("disk full: free space there and rerun (a run resumes from its last finished checkpoint)")
    ckpts = sorted(os.listdir(run / "checkpoints"))
    assert "2" in ckpts and not any(".orbax-checkpoint-tmp" in c for c in ckpts), ckpts
    assert_same_checkpoint(restored_state(run, 2), restored_state(reference_run, 2))
    # Space freed: the rerun resumes and finishes exactly as an uninterrupted run.
    rc, _ = cli(pretrain_args(run, corpus), capsys)
    assert rc == 0 and losses(run) == losses(reference_run)


def test_convert_and_rerun_use_the_newest_intact_step(reference_run, corpus, tmp_path, capsys, caplog):
    import numpy as np

    from c2jax.hf.safetensors_io import SafetensorsFile
    run = copy_run(reference_run, tmp_path / "run")
    victim = os.path.join(run, "checkpoints", str(STEPS), "state", "manifest.ocdbt")
    os.remove(victim)
    out = tmp_path / "hf"
    with caplog.at_level(logging.WARNING):
        rc, lines = cli(["convert", "--from", "orbax", run, "--to", str(out)], capsys)
    assert rc == 0, lines
    assert any(r.getMessage().startswith(f"checkpoint step {STEPS} cannot be restored ({victim} is missing")
               for r in caplog.records)
    f = SafetensorsFile(str(out / "model.safetensors"))
    embed = restored_state(reference_run, STEPS - 1)["leaves"]["['params']['embed']"]
    np.testing.assert_array_equal(f.read("model.embed_tokens.weight"), embed)
    f.close()
    # A finished run launched again restores its last step and writes no second copy of its rows.
    again = copy_run(reference_run, tmp_path / "again")
    rc, _ = cli(pretrain_args(again, corpus), capsys)
    assert rc == 0 and losses(again) == losses(reference_run)    # losses() rejects duplicate rows
    assert json.load(open(os.path.join(again, "summary.json")))["start_step"] == STEPS


def test_convert_on_a_full_disk_leaves_nothing_behind(reference_run, tmp_path, capsys, monkeypatch):
    import c2jax.hf.checkpoint as hf_checkpoint
    real = hf_checkpoint.write_file

    def write_file(tensors, path, metadata=None):   # the disk fills up half-way through the file
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    monkeypatch.setattr(hf_checkpoint, "write_file", write_file)
    out = tmp_path / "hf"
    rc, lines = cli(["convert", "--from", "orbax", reference_run, "--to", str(out)], capsys)
    assert rc == 2 and lines == [f"error (ENOSPC) at {out}/model.safetensors: disk full: free space there and "
                                 "rerun (a run resumes from its last finished checkpoint)"], lines
    assert not out.exists()
    monkeypatch.setattr(hf_checkpoint, "write_file", real)
    rc, _ = cli(["convert", "--from", "orbax", reference_run, "--to", str(out)], capsys)
    assert rc == 0 and (out / "model.safetensors").exists()
