"""Sandbox escape suite: every attempt is contained and reported, the host is unchanged.

Only this machine is touched: the network test listens and connects on host loopback, and
outside addresses are checked by the absence of interfaces and routes (no packet is sent).
Every attack is bounded in time by the sandbox's own limits.
"""
import hashlib
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

import c2jax.agent.sandbox as sbx
from c2jax.agent.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from c2jax.agent.workspace import Workspace

pytestmark = pytest.mark.skipif(bool(sbx.unavailable_reason()), reason="bubblewrap unavailable")


def _procs_of_uid(uid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "status").read_text().splitlines():
                if line.startswith("Uid:") and str(uid) in line.split()[1:]:
                    out.append(int(d.name))
        except OSError:
            pass
    return out


def _wait_no_procs(uid: int, timeout: float = 3.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = _procs_of_uid(uid)
        if not left:
            return []
        time.sleep(0.05)
    return _procs_of_uid(uid)


@pytest.fixture(scope="module")
def host_state(tmp_path_factory):
    """A host secret plus fingerprints of host paths an attack might touch."""
    d = tmp_path_factory.mktemp("host")
    secret = d / "secret.txt"
    secret.write_text("HOST-SECRET-7f3a\n")
    os.chmod(secret, 0o600)
    watched = [Path("/etc/passwd"), Path("/etc/hostname"), secret]

    def fingerprint():
        fp = {}
        for p in watched:
            try:
                fp[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            except OSError:
                fp[str(p)] = None
        fp["hostname"] = socket.gethostname()
        return fp

    before = fingerprint()
    yield {"secret": secret, "fingerprint": fingerprint, "before": before}
    after = fingerprint()
    assert after["hostname"] == before["hostname"]
    for k in watched:
        assert after[str(k)] == before[str(k)], f"host file {k} changed"


def test_unprivileged_no_caps(sandbox, workdir):
    r = sandbox.run(["sh", "-c", "id -u; grep -E 'CapEff|CapBnd|NoNewPrivs' /proc/self/status; hostname"], workdir)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] != "0"
    assert "0000000000000000" in r.stdout.split("CapEff:")[1].split()[0]
    assert r.stdout.split("NoNewPrivs:")[1].split()[0] == "1"
    assert "sandbox" in r.stdout


def test_setuid_and_mount_do_not_escalate(sandbox, workdir):
    r = sandbox.run(["sh", "-c", ("su -c id root </dev/null; echo su=$?; mount -t tmpfs none /task 2>&1; "
                     "echo mount=$?; unshare -r id 2>&1; echo unshare=$?")], workdir, timeout_s=5)
    assert "su=0" not in r.stdout
    assert "mount=0" not in r.stdout
    assert "uid=0(root)" not in r.stdout.split("su=")[0]
    assert "unshare=0" not in r.stdout  # no nested user namespaces


def test_network_blocked(sandbox, workdir):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted = []
    done = threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(srv.accept())
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    code = (
        "import socket\n"
        f"s = socket.socket(); s.settimeout(1)\n"
        f"try:\n    s.connect(('127.0.0.1', {port})); print('CONNECTED')\n"
        "except OSError as e:\n    print('refused', e)\n"
        "print('IFACES', sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
        "print('ROUTES', len(open('/proc/net/route').readlines()) - 1)\n")
    r = sandbox.run(["python3", "-c", code], workdir, timeout_s=5)
    time.sleep(0.3)
    done.set()
    t.join()
    srv.close()
    assert r.returncode == 0, r.stderr
    assert "CONNECTED" not in r.stdout and not accepted
    assert "IFACES ['lo']" in r.stdout  # no interface to the outside world exists
    assert "ROUTES 0" in r.stdout        # and no route: outside addresses are unreachable


def test_host_files_unreadable(sandbox, workdir, host_state):
    home = os.path.expanduser("~")
    targets = ["/etc/shadow", "/etc/sudoers", str(host_state["secret"]), f"{home}/.bashrc",
               f"{home}/.ssh/id_rsa", str(Path(__file__).resolve().parents[2] / "README.md"),
               str(Path(sbx.__file__).resolve())]
    cmd = "; ".join(f"cat {t} >/dev/null 2>&1 && echo READ:{t}" for t in targets)
    os.environ["C2JAX_HOST_SECRET_ENV"] = "HOST-SECRET-ENV"
    try:
        cmd += f"; cat /etc/passwd; ls -a {home}; env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"
        r = sandbox.run(["sh", "-c", cmd], workdir, timeout_s=5)
    finally:
        del os.environ["C2JAX_HOST_SECRET_ENV"]
    assert "READ:" not in r.stdout, r.stdout
    assert "HOST-SECRET" not in r.stdout
    assert "daemon:" not in r.stdout and "sandbox:x:" in r.stdout  # a synthetic passwd, not the host's
    # the home directory holds at most the bound Python runtime (read-only)
    entries = set(r.stdout.split("HOME=")[0].split()) - {".", ".."}
    assert not any(e.startswith((".ssh", ".bash", ".cache", ".config")) for e in entries), entries


def test_hidden_tests_not_visible(sandbox, fake_task):
    ws = Workspace.create(fake_task, sandbox=sandbox)
    try:
        assert not (ws.path / ".c2jax_hidden").exists()
        r = sandbox.run(["sh", "-c", ("grep -rl HIDDEN_OK /task /tmp 2>/dev/null; find / -path /proc -prune "
                         "-o -path /usr -prune -o -name '*hidden*' -print 2>/dev/null | grep -v pyenv; ls -a /task")],
                        ws.path, timeout_s=8)
        assert "HIDDEN_OK" not in r.stdout and ".c2jax_hidden" not in r.stdout
        assert ".git" not in r.stdout.split()
    finally:
        ws.cleanup()


def test_writes_outside_task_dir_fail(sandbox, workdir, host_state):
    marker = f"c2jax-escape-{os.getpid()}"
    targets = ["/usr/" + marker, "/etc/" + marker, "/" + marker, os.path.expanduser("~") + "/" + marker,
               "/proc/sys/kernel/hostname", "/var/" + marker, sbx.__file__]
    script = "; ".join(f"(echo x > {t}) 2>/dev/null && echo WROTE:{t}" for t in targets)
    script += f"; echo x > /tmp/{marker} && echo TMP_OK; echo y > /task/inside.txt && echo TASK_OK"
    r = sandbox.run(["sh", "-c", script], workdir, timeout_s=5)
    assert "WROTE:" not in r.stdout, r.stdout
    assert "TMP_OK" in r.stdout and "TASK_OK" in r.stdout
    assert (workdir / "inside.txt").read_text() == "y\n"
    for t in [t for t in targets if marker in t] + [f"/tmp/{marker}"]:
        assert not os.path.exists(t), t
    assert not [x for x in os.listdir("/tmp") if marker in x]


def test_fork_storm_contained(workdir):
    sb = Sandbox(SandboxLimits(cpu_s=5, memory_mb=256, max_procs=32, wall_s=3, output_bytes=4000))
    t0 = time.monotonic()
    r = sb.run(["bash", "-c", "f() { f | f & }; f; sleep 10"], workdir)
    assert time.monotonic() - t0 < 8
    assert r.returncode != 0 or r.killed_reason
    uid = os.stat(workdir).st_uid
    if os.geteuid() == 0:
        assert _wait_no_procs(uid) == []
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork


def test_memory_bomb_contained(workdir):
    sb = Sandbox(SandboxLimits(cpu_s=10, memory_mb=200, max_procs=32, wall_s=10))
    r = sb.run(["python3", "-c", "x = bytearray(2 << 30); print('ALLOCATED')"], workdir)
    assert "ALLOCATED" not in r.stdout and r.returncode != 0
    # many processes, each under the per-process cap: the cgroup (when present) caps the sum
    code = ("import os\nfor _ in range(6):\n    if os.fork() == 0:\n        break\n"
            "x = bytearray(150 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\n"
            "import time; time.sleep(2); print('SURVIVED')")
    r = sb.run(["python3", "-c", code], workdir)
    if sb.cgroups.kind:
        assert r.stdout.count("SURVIVED") < 7, (r.stdout, r.killed_reason)
        assert r.killed_reason == "memory"


def test_infinite_loop_hits_cpu_limit(workdir):
    sb = Sandbox(SandboxLimits(cpu_s=1, wall_s=15))
    t0 = time.monotonic()
    r = sb.run(["python3", "-c", "while True: pass"], workdir)
    assert time.monotonic() - t0 < 6
    assert r.killed_reason in ("cpu", "signal:9"), r
    assert not r.ok


def test_sleep_past_limit_and_background_procs_killed(sandbox, workdir):
    t0 = time.monotonic()
    r = sandbox.run(["sleep", "30"], workdir, timeout_s=1)
    assert r.timed_out and r.killed_reason == "wall_clock"
    assert time.monotonic() - t0 < 4
    t0 = time.monotonic()
    r = sandbox.run(["sh", "-c", "(sleep 30 &); setsid sleep 30 & nohup sleep 30 >/dev/null 2>&1 & echo started"],
                    workdir, timeout_s=5)
    assert "started" in r.stdout and time.monotonic() - t0 < 4
    if os.geteuid() == 0:
        assert _wait_no_procs(os.stat(workdir).st_uid) == []


def test_huge_output_truncated_and_stopped(sandbox, workdir):
    t0 = time.monotonic()
    r = sandbox.run(["yes", "spam"], workdir, timeout_s=8)
    assert time.monotonic() - t0 < 6
    assert r.truncated and r.killed_reason == "output_limit"
    assert len(r.stdout) <= sandbox.limits.output_bytes


def test_file_size_limit(sandbox, workdir):
    sandbox.run(["sh", "-c", "head -c 10000000 /dev/zero > big.bin"], workdir, timeout_s=5)
    assert (workdir / "big.bin").stat().st_size <= sandbox.limits.file_size_mb * 1024 * 1024


def test_killing_the_parent_is_contained(sandbox, workdir):
    sentinel = subprocess.Popen(["sleep", "30"])
    try:
        r = sandbox.run(["sh", "-c", (f"kill -9 {sentinel.pid} 2>/dev/null && echo KILLED_SENTINEL; "
                         "kill -9 $PPID; kill -9 1; kill -9 -1; echo after")], workdir, timeout_s=5)
        assert "KILLED_SENTINEL" not in r.stdout
        assert sentinel.poll() is None  # the host process is untouched
        r2 = sandbox.run(["echo", "still-works"], workdir)
        assert r2.stdout.strip() == "still-works"
    finally:
        sentinel.kill()
        sentinel.wait()


def test_concurrent_sandboxes_are_isolated(sandbox, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "secret_b.txt").write_text("B-ONLY")
    results = {}

    def go(name, d, cmd):
        results[name] = sandbox.run(["sh", "-c", cmd], d, timeout_s=5)

    ts = [threading.Thread(target=go, args=("a", a, "cat /task/secret_b.txt; ls /task; ps -e | wc -l")),
          threading.Thread(target=go, args=("b", b, "sleep 0.5; cat /task/secret_b.txt"))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert "B-ONLY" not in results["a"].stdout
    assert results["b"].stdout.strip() == "B-ONLY"
    if os.geteuid() == 0:
        assert os.stat(a).st_uid != os.stat(b).st_uid  # one uid per workspace: per-sandbox NPROC


def test_refuses_without_bwrap(monkeypatch):
    monkeypatch.setattr(sbx, "_BWRAP_STATUS", {})
    monkeypatch.setattr(sbx.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox()


def test_bad_argv_rejected(sandbox, workdir):
    with pytest.raises(ValueError):
        sandbox.run([], workdir)
    r = sandbox.run(["echo", "a\0b"], workdir)
    assert r.returncode != 0
    r = sandbox.run(["definitely-not-a-command"], workdir)
    assert r.returncode != 0 and not r.timed_out
    shutil.rmtree(workdir)
    with pytest.raises(FileNotFoundError):
        sandbox.run(["true"], workdir)


def test_disk_fill_capped(fake_task):
    sb = Sandbox(SandboxLimits(disk_mb=32, file_size_mb=4, wall_s=10))
    ws = Workspace.create(fake_task, sandbox=sb)
    try:
        if not ws.quota_mounted:
            pytest.skip("cannot mount a tmpfs quota here (not root)")
        r = sb.run(["sh", "-c", ("i=0; while [ $i -lt 40 ]; do head -c 4000000 /dev/zero > f$i || break; "
                    "i=$((i+1)); done; echo wrote=$i")], ws.path)
        assert "wrote=40" not in r.stdout
        used = sum(p.stat().st_size for p in ws.path.iterdir() if p.is_file())
        assert used <= 32 * 1024 * 1024
        assert (ws.path / "calc.py").exists()
    finally:
        path = ws.path
        ws.cleanup()
    assert not os.path.ismount(path) and not path.exists()
