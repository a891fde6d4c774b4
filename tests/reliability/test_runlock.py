"""One run per workdir: a second holder fails at once naming the first's pid and host; the lock
goes with its process (exit, SIGTERM, SIGKILL), so a dead run's lock never blocks the next."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from c2jax.errors import WorkdirLocked
from c2jax.failures import one_line
from c2jax.runlock import WorkdirLock, ensure_free, workdir_lock

HOLD = ("import sys, time\nfrom c2jax.runlock import workdir_lock\n"
        "with workdir_lock(sys.argv[1], primary=True):\n    print('held', flush=True)\n    time.sleep(60)\n")


def _holder(workdir):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_holder_fails_at_once_naming_the_first(tmp_path):
    with workdir_lock(str(tmp_path), primary=True):
        t = time.time()
        with pytest.raises(WorkdirLocked) as e:
            WorkdirLock(str(tmp_path)).acquire()
        with pytest.raises(WorkdirLocked):
            ensure_free(str(tmp_path))
        assert time.time() - t < 1.0
    msg = one_line(e.value)
    assert msg.startswith(f"error (WorkdirLocked): {tmp_path} is in use by pid {os.getpid()} "
                          f"on host {socket.gethostname()}") and "\n" not in msg
    with workdir_lock(str(tmp_path), primary=True) as lock:    # released on exit: free again
        assert lock.held
    ensure_free(str(tmp_path))


def test_only_process_zero_locks(tmp_path):
    with workdir_lock(str(tmp_path), primary=True), workdir_lock(str(tmp_path), primary=False) as other:
        assert not other.held


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_lock_of_a_killed_process_is_not_stale(tmp_path, sig):
    p = _holder(tmp_path)
    with pytest.raises(WorkdirLocked, match=f"pid {p.pid} on host"):
        WorkdirLock(str(tmp_path)).acquire()
    p.send_signal(sig)
    p.wait(timeout=30)
    with workdir_lock(str(tmp_path), primary=True):
        pass


def test_unwritable_lock_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(Exception) as e:
        WorkdirLock(str(blocker / "run")).acquire()
    msg = one_line(e.value)
    assert msg is not None and str(blocker / "run") in msg and "\n" not in msg


def test_lock_kept_by_a_forked_child_names_the_exited_holder(tmp_path):
    code = ("import os, sys, time\nfrom c2jax.runlock import WorkdirLock\n"
            "WorkdirLock(sys.argv[1]).acquire()\n"
            "child = os.fork()\nif child == 0:\n    time.sleep(60)\n    os._exit(0)\n"
            "print(child, flush=True)\nos._exit(0)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    child = int(p.stdout.readline())
    p.wait(timeout=30)
    try:
        with pytest.raises(WorkdirLocked, match=f"pid {p.pid} on host .*which has exited: a process it forked"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.time() + 10
    while True:     # the child gone, the lock is free
        try:
            with workdir_lock(str(tmp_path), primary=True):
                break
        except WorkdirLocked:
            assert time.time() < deadline
            time.sleep(0.05)
