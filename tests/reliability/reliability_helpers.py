"""Shared pieces of the fault-injection tests: the tiny training run of tests/train (its
small_overrides), run in this process through the CLI, and checks on run directories."""
import importlib.util
import json
import os
import pathlib
import re
import shutil
import textwrap

import numpy as np

_spec = importlib.util.spec_from_file_location("_train_conftest",
                                               pathlib.Path(__file__).parents[1] / "train" / "conftest.py")
train_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_conftest)
small_overrides = train_conftest.small_overrides

CONFIG = "configs/stages/cpt.py:tiny"
STEPS = 4


def make_corpus(root) -> str:
    """The tests/train small corpus (60 files) under root."""
    os.makedirs(root, exist_ok=True)
    for i, snippet in enumerate(train_conftest.SNIPPETS * 20):
        body = snippet.replace("add", f"add_{i}").replace("Stack", f"Stack{i}")
        (pathlib.Path(root) / f"mod_{i}.py").write_text(textwrap.dedent(body) * (1 + i % 4))
    return str(root)


def cli(args: list[str], capsys) -> tuple[int, list[str]]:
    """Run `python -m c2jax ARGS` in this process; (exit code, stderr lines that are not log lines)."""
    from c2jax.cli import main
    capsys.readouterr()
    rc = main(list(args))
    err = capsys.readouterr().err
    shown = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]   # what a terminal shows
    return rc, [line for line in shown if line.strip() and not _is_log(line)]


def _is_log(line: str) -> bool:
    parts = line.split(" ", 3)
    return (len(parts) > 2 and parts[2] in ("INFO", "WARNING", "DEBUG") or line.startswith(("step ", "cpt:", "sft:"))
            or re.match(r"(load|save) (\[|\d+ tensors)", line) is not None)   # progress lines


def pretrain_args(workdir, corpus, steps=STEPS, extra=()) -> list[str]:
    return ["pretrain", "--config", CONFIG, "--workdir", str(workdir), *small_overrides(corpus, steps, extra)]


def losses(workdir) -> dict[int, float]:
    """{step: loss} of metrics.jsonl; asserts no step has two training rows."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r["step"] for r in rows if "loss" in r]
    assert len(train) == len(set(train)), f"duplicate training rows: {train}"
    evals = [r["step"] for r in rows if "eval/heldout_loss" in r]
    assert len(evals) == len(set(evals)), f"duplicate eval rows: {evals}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def restored_state(run_dir, step) -> dict:
    """{leaf path: numpy array} of a checkpoint step's state, plus its data and meta JSON."""
    import jax
    import orbax.checkpoint as ocp
    mgr = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"),
                                options=ocp.CheckpointManagerOptions(read_only=True))
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore(),
                                                    meta=ocp.args.JsonRestore()))
    mgr.close()
    leaves = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(out["state"])}
    return {"leaves": leaves, "data": out["data"], "meta": out["meta"]}


def assert_same_checkpoint(a, b):
    """Two restored checkpoints are bit-identical (every leaf's bytes, the data/meta JSON)."""
    assert sorted(a["leaves"]) == sorted(b["leaves"])
    for k, v in a["leaves"].items():
        assert v.dtype == b["leaves"][k].dtype and v.tobytes() == b["leaves"][k].tobytes(), k
    assert a["data"] == b["data"] and a["meta"] == b["meta"]


def copy_run(src, dst) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return str(dst)


def tree_bytes(path) -> dict[str, bytes]:
    """{relative path: content} of every file under path (to prove nothing was written)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out
