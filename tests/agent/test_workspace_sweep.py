"""Workspaces left by a killed process are removed (quota mount included) by the next one."""
import os
import subprocess
import sys

import pytest

from c2jax.agent import workspace as wsmod
from c2jax.agent.sandbox import Sandbox, unavailable_reason


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _make(base, ns, pid, task="t"):
    root = base / f"c2jax-ws-{ns}-{pid}-{task}-x1"
    (root / "repo").mkdir(parents=True)
    (root / "repo" / "a.py").write_text("print(1)\n")
    return root


def test_sweep_removes_only_dead_processes_workspaces(tmp_path):
    ns = wsmod._pid_namespace()
    dead = _make(tmp_path, ns, _dead_pid())
    live = _make(tmp_path, ns, os.getpid())
    other_ns = _make(tmp_path, ns + 1, _dead_pid())  # another pid namespace: its pids are not ours to judge
    unowned = tmp_path / "c2jax-ws-synthetic-L1-abc-x2"  # the old name without an owner: kept
    unowned.mkdir()
    assert wsmod.sweep_stale_workspaces(str(tmp_path)) == 1
    assert not dead.exists() and live.exists() and other_ns.exists() and unowned.exists()
    assert wsmod.sweep_stale_workspaces(str(tmp_path)) == 0


def test_new_workspaces_carry_their_owner_and_sweep_first(tmp_path):
    class Task:
        task_id, files = "demo/task 1", {"m.py": "x = 1\n"}
    stale = _make(tmp_path, wsmod._pid_namespace(), _dead_pid())
    ws = wsmod.Workspace.create(Task(), base_dir=tmp_path)
    try:
        assert ws.root.name.startswith(f"c2jax-ws-{wsmod._pid_namespace()}-{os.getpid()}-demo_task_1-")
        assert (ws.path / "m.py").read_text() == "x = 1\n"
        assert not stale.exists()  # the first workspace of a process sweeps its base dir
    finally:
        ws.cleanup()
    assert not ws.root.exists()


@pytest.mark.skipif(os.geteuid() != 0 or bool(unavailable_reason()), reason="quota mounts need root and the sandbox")
def test_sweep_unmounts_a_left_quota_mount(tmp_path):
    root = _make(tmp_path, wsmod._pid_namespace(), _dead_pid())
    repo = root / "repo"
    for f in repo.iterdir():
        f.unlink()
    if not Sandbox().mount_quota(repo):
        pytest.skip("tmpfs mount refused here")
    (repo / "big.txt").write_text("y" * 1000)
    assert os.path.ismount(repo)
    assert wsmod.sweep_stale_workspaces(str(tmp_path)) == 1
    assert not root.exists()
