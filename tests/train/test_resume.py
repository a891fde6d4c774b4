"""Exact resume: a run SIGKILLed mid-way and restarted logs the same per-step losses."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import small_overrides

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _cmd(workdir, corpus, steps):
    return [sys.executable, "-m", "c2jax", "pretrain", "--config", "configs/stages/cpt.py:tiny",
            "--workdir", str(workdir), *small_overrides(corpus, steps)]


def _losses(workdir):
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    out = {}
    for r in rows:
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def test_sigkill_and_resume_reproduces_losses(tmp_path, small_corpus):
    steps = 8
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    subprocess.run(_cmd(ref_dir, small_corpus, steps), check=True, env=ENV, capture_output=True, timeout=900)
    proc = subprocess.Popen(_cmd(run_dir, small_corpus, steps), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline:
        if metrics.exists() and len(_losses(run_dir)) >= 4:
            break
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(_losses(run_dir))
    assert killed_at < steps, "the run finished before it could be killed; test is void"
    subprocess.run(_cmd(run_dir, small_corpus, steps), check=True, env=ENV, capture_output=True, timeout=900)
    ref, got = _losses(ref_dir), _losses(run_dir)
    assert sorted(ref) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step] == ref[step], (step, got[step], ref[step])
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["start_step"] > 0 and summary["final_step"] == steps
