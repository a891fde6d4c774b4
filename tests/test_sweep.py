"""Sweep expansion, running with a fake runner, skip-if-done, failures, collection."""
import json
import os
import textwrap

import ml_collections
import pytest

from c2jax import sweep


def make_cfg(**kw):
    c = ml_collections.ConfigDict()
    c.base = "configs/rl_small.py:tiny"
    c.command = "rl"
    c.metrics = ["eval/accuracy", "train/loss"]
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_expand_grid_pairs_with_seeds():
    cfg = make_cfg(grid=[("model.num_experts", [8, 16]), ("rl.kl_coef", [0.0, 1e-3])], seeds=[0, 1])
    pts = sweep.expand(cfg)
    assert len(pts) == 8
    assert pts[0].name == "model.num_experts=8,rl.kl_coef=0.0,seed=0"
    assert pts[-1].name == "model.num_experts=16,rl.kl_coef=0.001,seed=1"
    assert pts[1].overrides == {"model.num_experts": 8, "rl.kl_coef": 0.0, "seed": 1}
    assert [p.name for p in sweep.expand(cfg)] == [p.name for p in pts]  # stable


def test_expand_nested_grid_and_points():
    cfg = make_cfg(grid={"model": {"num_experts": [8, 16]}, "rl": {"normalizer": ["constant", "seq_len"]}})
    names = [p.name for p in sweep.expand(cfg)]
    assert names == ["model.num_experts=8,rl.normalizer=constant", "model.num_experts=8,rl.normalizer=seq_len",
                     "model.num_experts=16,rl.normalizer=constant", "model.num_experts=16,rl.normalizer=seq_len"]
    cfg = make_cfg(points=[{"rl.kl_estimator": "k1"}, {"rl.kl_estimator": "k3", "rl.kl_coef": 0.01}])
    pts = sweep.expand(cfg)
    assert [p.name for p in pts] == ["rl.kl_estimator=k1", "rl.kl_estimator=k3,rl.kl_coef=0.01"]
    with pytest.raises(ValueError, match="duplicate"):
        sweep.expand(make_cfg(points=[{"a": 1}, {"a": 1}]))
    with pytest.raises(ValueError, match="either"):
        sweep.expand(make_cfg(points=[{"a": 1}], grid=[("a", [1])]))
    assert len(sweep.point_name({"data.path": "/a/b" * 100})) <= 200


class FakeRunner:
    """Writes metrics like a training run; fails on chosen points."""

    def __init__(self, fail=(), bad_rc=()):
        self.calls, self.fail, self.bad_rc = [], set(fail), set(bad_rc)

    def __call__(self, command, base, overrides, run_dir):
        self.calls.append((command, base, dict(overrides), run_dir))
        e = overrides.get("model.num_experts")
        if e in self.fail:
            raise RuntimeError(f"boom {e}")
        if e in self.bad_rc:
            return 3
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps({"step": step, "train/loss": 10.0 - step - e / 100}) + "\n" for step in range(3))
            f.write(json.dumps({"step": 3, "eval/accuracy": e / 100}) + "\n")
            f.write('{"step": 4, "train/lo')  # partial line from a crash mid-write
        return 0


def test_run_skip_failure_and_collect(tmp_path):
    cfg = make_cfg(grid=[("model.num_experts", [4, 8, 16, 32])])
    wd = str(tmp_path / "sw")
    r = FakeRunner(fail={8}, bad_rc={16})
    res = sweep.run_sweep(cfg, wd, runner=r, log=lambda s: None)
    assert [x.status for x in res] == ["done", "failed", "failed", "done"]
    assert "boom 8" in res[1].error and "exit code 3" in res[2].error
    assert len(r.calls) == 4 and r.calls[0][:2] == ("rl", "configs/rl_small.py:tiny")
    assert os.path.exists(os.path.join(wd, "model.num_experts=4", "DONE"))
    assert os.path.exists(os.path.join(wd, "model.num_experts=8", "FAILED"))
    assert "| model.num_experts=4 | 4 | done | 0.04 |" in (tmp_path / "sw" / "results.md").read_text()
    # rerun: done points skipped, failed ones retried (and now succeed)
    r2 = FakeRunner()
    res = sweep.run_sweep(cfg, wd, runner=r2, log=lambda s: None)
    assert [x.status for x in res] == ["skipped", "done", "done", "skipped"]
    assert [c[2]["model.num_experts"] for c in r2.calls] == [8, 16]
    assert not os.path.exists(os.path.join(wd, "model.num_experts=8", "FAILED"))
    # results.json takes precedence over metrics.jsonl
    with open(os.path.join(wd, "model.num_experts=32", "results.json"), "w") as f:
        json.dump({"eval": {"accuracy": 0.99}}, f)
    table = sweep.collect(wd, cfg.metrics)
    assert table.columns == ["point", "model.num_experts", "status", "eval/accuracy", "train/loss"]
    rows = {row[1]: row for row in table.rows}
    assert [row[1] for row in table.rows] == [16, 32, 4, 8]  # sorted dir names
    assert rows[4][2:] == ["done", 0.04, 10.0 - 2 - 0.04]
    assert rows[32][3] == 0.99
    md = (tmp_path / "sw" / "results.md").read_text()
    assert md.startswith("| point | model.num_experts | status |") and "0.99" in md
    assert (tmp_path / "sw" / "results.csv").read_text().splitlines()[0] == ",".join(table.columns)
    # with explicit points, order follows the sweep and missing points are listed
    t2 = sweep.collect(wd, cfg.metrics, points=sweep.expand(make_cfg(grid=[("model.num_experts", [4, 64])])), write=False)
    assert [row[2] for row in t2.rows] == ["done", "missing"]


def test_dry_run_and_launch_commands(tmp_path):
    cfg = make_cfg(grid=[("rl.normalizer", ["constant", "seq_len"])], seeds=[0])
    wd = str(tmp_path / "sw")
    lines = []
    res = sweep.run_sweep(cfg, wd, runner=FakeRunner(), dry_run=True, log=lines.append)
    assert [x.status for x in res] == ["dry_run"] * 2 and not os.path.exists(wd)
    assert "--config.rl.normalizer=constant" in lines[0] and "--config.seed=0" in lines[0]
    cmds = sweep.launch_commands(cfg, wd, path=str(tmp_path / "launch.sh"))
    assert len(cmds) == 2 and "python -m c2jax rl --config configs/rl_small.py:tiny" in cmds[1]
    assert cmds[0].startswith(f"[ -f {wd}/rl.normalizer=constant,seed=0/DONE ] ||")
    assert sweep.build_command("rl", "b.py", {"a.b": True, "c": 1.0}, "d")[-4:] == [
        "--config.a.b=True", "--config.c=1.0", "--workdir", "d"]


def test_script_command(tmp_path):
    """A command ending in .py runs that script with the same flags (experiments/*.py runners)."""
    argv = sweep.build_command("experiments/rl_toy.py", "configs/rl_tiny.py:toy", {"rl.steps": 3}, "d", python="py")
    assert argv == ["py", "experiments/rl_toy.py", "--config", "configs/rl_tiny.py:toy", "--config.rl.steps=3",
                    "--workdir", "d"]
    script = tmp_path / "point.py"
    script.write_text("import sys, json, os\n"
                      "a = sys.argv[1:]\n"
                      "wd = a[a.index('--workdir') + 1]\n"
                      "json.dump({'loss': float(a[2].split('=')[1])}, open(os.path.join(wd, 'results.json'), 'w'))\n")
    cfg = make_cfg(command=str(script), points=[{"x": 0.5}, {"x": 2.0}], metrics=["loss"])
    wd = str(tmp_path / "sw")
    res = sweep.run_sweep(cfg, wd, log=lambda _: None)
    assert [r.status for r in res] == ["done", "done"]
    assert [row[-1] for row in sweep.collect(wd, ["loss"]).rows] == [0.5, 2.0]


def test_launch_line_runs_in_shell(tmp_path):
    """The launch line skips DONE points and writes DONE on success (python -> `true`)."""
    cfg = make_cfg(points=[{"x": 1}])
    wd = str(tmp_path / "w")
    (line,) = sweep.launch_commands(cfg, wd, python="true")
    assert os.system(line) == 0 and os.path.exists(os.path.join(wd, "x=1", "DONE"))


def test_load_sweep_file(tmp_path):
    p = tmp_path / "s.py"
    p.write_text(textwrap.dedent("""
        import ml_collections
        def get_config(arg="a"):
            c = ml_collections.ConfigDict()
            c.base, c.command, c.metrics = "b.py", "rl", ["m"]
            c.grid = [("k", [1, 2] if arg == "a" else [3])]
            return c
    """))
    assert len(sweep.expand(sweep.load_sweep(str(p)))) == 2
    assert [x.name for x in sweep.expand(sweep.load_sweep(f"{p}:b"))] == ["k=3"]
