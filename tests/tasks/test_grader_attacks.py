"""The grader against known attacks (c2jax.tasks.attacks): forged passes fail, links leak nothing.

Runs in the harness sandbox, on every suite built on the harness runner, directly and through
the episode runner and the RL reward.
"""
import dataclasses
import os

import pytest

from c2jax.agent.policy import OraclePolicy
from c2jax.agent.runner import EpisodeConfig, run_episode
from c2jax.agent.sandbox import Sandbox
from c2jax.agent.workspace import Workspace, read_tree, write_tree_files
from c2jax.rl.losses import default_rl_loss_config
from c2jax.rl.rewards import compute_reward
from c2jax.rl.rollout import reward_stats
from c2jax.tasks import load_suite, snapshot_files
from c2jax.tasks import attacks as atk
from c2jax.tasks.base import apply_edit_to_files, reference_files

SUITES = ("synthetic:1", "synthetic:3", "humaneval", "long_horizon_small")


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox()


def _tasks():
    out = [load_suite(s, "train", n=1)[0] for s in SUITES]
    beh = load_suite("behaviour", "train", n=12)
    out += [next(t for t in beh if t.grader == c and t.hidden_tests) for c in ("rules", "quality", "interruption")]
    return [dataclasses.replace(t, timeout_s=3.0) for t in out]  # a stopped judge costs the whole timeout


def _grade_files(task, files, sandbox):
    """Grades `task` on a workspace holding `files` (written the way the agent's tools would)."""
    ws = Workspace.create(task, sandbox=sandbox)
    try:
        write_tree_files(ws.path, {p: c for p, c in files.items() if task.files.get(p) != c})
        ep = {"final_message": task.reference_message, "tool_calls": [], "original_files": task.files}
        return task.grade(ws.path, sandbox.run, ep)
    finally:
        ws.cleanup()


def test_attack_lists_are_big_enough():
    assert len(atk.all_forged_pass_attacks()) >= 11 and len(atk.LEAKS) >= 11


@pytest.mark.parametrize("task", _tasks(), ids=lambda t: t.suite + "-" + (t.grader or "code"))
def test_forged_passes_fail_in_sandbox(task, sandbox):
    assert _grade_files(task, reference_files(task), sandbox).passed
    passed = []
    for name in atk.all_forged_pass_attacks():
        files = dict(task.files)
        for call in atk.forged_pass_edits(task, name):
            files = apply_edit_to_files(files, call)
        g = _grade_files(task, files, sandbox)
        if g.passed or g.score >= 1.0:
            passed.append((name, str(g.details)[:300]))
    assert not passed, passed


@pytest.mark.parametrize("suite", ["humaneval", "synthetic:2"])
def test_forged_passes_earn_no_reward_through_the_episode_runner(suite, sandbox):
    task = dataclasses.replace(load_suite(suite, "train", n=1)[0], timeout_s=3.0)
    cfg = default_rl_loss_config()
    for name in atk.all_forged_pass_attacks():
        edits = atk.forged_pass_edits(task, name)
        scripted = dataclasses.replace(task, reference_solution=edits, reference_message="Done.")
        res = run_episode(task, OraclePolicy(scripted), None, sandbox,
                          EpisodeConfig(max_turns=len(edits) + 2, keep_workspace=True))
        try:
            final = snapshot_files(res.workspace.path)
        finally:
            res.workspace.cleanup()
        assert res.grade is not None and not res.grade.passed, (name, res.grade)
        total, terms = compute_reward(res.grade.score, reward_stats(res.stats, task.files, final), cfg)
        assert terms["verifier"] < 1.0 and res.trajectory.reward_terms["verifier"] < 1.0, name


@pytest.mark.parametrize("leak", atk.LEAKS)
def test_links_out_of_the_tree_leak_nothing(leak, tmp_path, sandbox):
    target = atk.make_leak_target(tmp_path)
    beh = [t for t in load_suite("behaviour", "train", n=12) if t.grader in ("question", "quality")]
    for task in [load_suite("synthetic:1", "train", n=1)[0], *beh[:2]]:
        ws = Workspace.create(task, sandbox=sandbox)
        try:
            atk.plant_leak(ws.path, leak, target, list(task.files))
            seen = [ws.snapshot(), ws.diff(), snapshot_files(ws.path), read_tree(ws.path)]
            ep = {"final_message": "", "tool_calls": [], "original_files": task.files}
            seen.append(task.grade(ws.path, sandbox.run, ep).details)
            text = repr(seen)
            assert target.secret not in text, (leak, task.task_id)
            assert target.file.read_text().startswith(target.secret)  # the host file is intact
            assert sorted(os.listdir(target.dir)) == ["nested", "secret.txt"]
        finally:
            ws.cleanup()


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as the tree's owner applies when the harness is root")
def test_root_reads_as_the_trees_owner(tmp_path, sandbox):
    task = load_suite("synthetic:1", "train", n=1)[0]
    ws = Workspace.create(task, sandbox=sandbox)
    try:
        p = ws.path / "root_only.txt"
        p.write_text("ROOT-ONLY")
        os.chown(p, 0, 0)
        os.chmod(p, 0o600)
        snap = read_tree(ws.path)
        assert snap["root_only.txt"] == "<unreadable>" and "ROOT-ONLY" not in repr(ws.snapshot())
    finally:
        ws.cleanup()


PROBE = '''import ctypes, os


def reach_judge():
    """Which of the judge's secrets the code under test can reach (all must be False)."""
    ppid = os.getppid()
    out = {}
    for name in ("mem", "environ", "fd/0", "fd/1", "maps"):
        try:
            with open(f"/proc/{ppid}/{name}", "rb") as f:
                f.read(1)
            out[name] = True
        except OSError:
            out[name] = False
    out["ptrace"] = ctypes.CDLL(None, use_errno=True).ptrace(16, ppid, 0, 0) == 0  # PTRACE_ATTACH
    return out
'''


def test_the_judge_is_out_of_reach_of_the_tested_code(sandbox):
    """In the sandbox (unprivileged, same uid as the judge): no /proc access, no ptrace."""
    from c2jax.tasks.grading import run_hidden_runner
    hidden = {"t.py": "from probe import reach_judge\n\nr = reach_judge()\nassert not any(r.values()), r\n"}
    task = load_suite("synthetic:1", "train", n=1)[0]
    ws = Workspace.create(dataclasses.replace(task, files={"probe.py": PROBE}), sandbox=sandbox)
    try:
        d = run_hidden_runner(hidden, ws.path, sandbox.run, 20)
    finally:
        ws.cleanup()
    assert d["passed"], d


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "(lambda: 1)()", "[" * 500 + "]" * 500,
                                  "x", "1 if True else 2", "{**{}}", "f'{1}'", "[i for i in ()]"])
def test_values_from_the_tested_code_are_plain_literals_only(text):
    from c2jax.tasks.hidden_runner import decode_literal
    with pytest.raises(ValueError):
        decode_literal(text)


def test_plain_values_round_trip():
    from c2jax.tasks.hidden_runner import decode_literal
    for v in [1, -2.5, float("inf"), "s", b"b", None, True, (1, [2, {3: "x"}]), {1, 2}, frozenset({3}), set(), 1 + 2j]:
        assert decode_literal(repr(v)) == v and type(decode_literal(repr(v))) is type(v)
    assert decode_literal(repr(float("nan"))) != decode_literal(repr(float("nan")))
