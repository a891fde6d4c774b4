"""Run untrusted (model-written) commands under bubblewrap.

Layers, outermost first (one `Popen` per command, no shell, no preexec_fn so it is safe to
call from many threads at once):

1. cgroup (best effort, cgroup v1 or v2 when writable): a per-command memory cap and pids cap
   over the whole sandbox, so N processes cannot each use `memory_mb`.
2. `prlimit`: RLIMIT_CPU / AS / NPROC / FSIZE / CORE / NOFILE, inherited by everything inside.
3. `bwrap`: new mount, pid, net, ipc, uts and cgroup namespaces; `--die-with-parent`,
   `--new-session`; a read-only minimal filesystem (/usr and its /bin /lib symlinks, the
   Python runtime, a few pure-Python packages such as pytest), a fresh size-capped /tmp,
   fresh /proc and /dev, the task directory writable at /task, an empty environment.
4. As root: `setpriv` drops to an unprivileged uid (one uid per workspace, so RLIMIT_NPROC
   is per sandbox) with no capabilities, an empty bounding set and no_new_privs. The outer
   bwrap runs as root for the binds (the Python runtime may live under a 0700 home, which an
   unprivileged bwrap could not bind), so a second, unprivileged `bwrap --unshare-user
   --disable-userns` inside unshares the user namespace and forbids nested ones.
   As a normal user: one `bwrap --unshare-all --unshare-user --disable-userns` as that user.
5. The harness enforces the wall clock: the whole process group is SIGKILLed, and with it
   bwrap, whose pid-1 child then takes every process in the sandbox's pid namespace along.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

INSTALL_HINT = ("install bubblewrap: `sudo apt-get update && sudo apt-get install -y bubblewrap` "
                "(or `make system-deps`)")
TASK_DIR = "/task"
# uids handed to workspaces when the harness runs as root; no passwd entries needed.
UID_BASE = 1_900_000_000
UID_POOL = 1_000_000
# Pure-Python packages from the harness's environment made importable inside the sandbox.
DEFAULT_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or util-linux's setpriv/prlimit) is missing or cannot create namespaces."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 30.0          # RLIMIT_CPU per process (soft; SIGKILL one second later)
    memory_mb: int = 1024        # RLIMIT_AS per process, and the cgroup cap for the sandbox
    max_procs: int = 64          # RLIMIT_NPROC for the sandbox uid, and the cgroup pids cap
    file_size_mb: int = 16       # RLIMIT_FSIZE: largest file a process may write
    wall_s: float = 60.0         # wall-clock limit per command (whole process group killed)
    output_bytes: int = 64_000   # stdout / stderr kept per stream; more is dropped (truncated)
    tmp_mb: int = 64             # size of the private /tmp tmpfs
    disk_mb: int = 512           # size cap of a workspace (a tmpfs mounted there when root)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclasses.dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_reason: str = ""      # "", "wall_clock", "cpu", "memory", "output_limit", "signal:N"
    wall_s: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed_reason


_BWRAP_STATUS: dict[str, str] = {}
_RUN_IDS = itertools.count()  # cgroup names, unique across Sandbox instances
_BWRAP_LOCK = threading.Lock()


def require_bwrap() -> str:
    """Returns the bwrap path, or raises SandboxUnavailable saying how to install it."""
    with _BWRAP_LOCK:
        if "path" in _BWRAP_STATUS:
            return _BWRAP_STATUS["path"]
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(
                "refusing to run model-written code without a sandbox: bwrap not found; " + INSTALL_HINT)
        for tool in ("prlimit", "setpriv"):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"`{tool}` (util-linux) not found; install util-linux")
        probe = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                 "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                 "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "/bin/true"]
        if os.geteuid() != 0:
            probe[1:1] = ["--unshare-user"]
        r = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
        if r.returncode != 0:
            raise SandboxUnavailable(
                f"bwrap cannot create namespaces here ({r.stderr.strip()[:300]}); run on a host "
                "that allows them (root, or unprivileged user namespaces enabled)")
        _BWRAP_STATUS["path"] = bwrap
        return bwrap


def unavailable_reason() -> str:
    """"" when the sandbox can run here, else why not (for test skips and CLI messages)."""
    try:
        require_bwrap()
        return ""
    except SandboxUnavailable as e:
        return str(e)


def _root_entries() -> list[str]:
    """bwrap args for a minimal read-only root: /usr plus the /bin, /lib... links into it."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    args += ["--perms", "0755", "--dir", "/etc"]
    for etc in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        if os.path.exists(etc):
            args += ["--ro-bind", etc, etc]
    return args


def _mkdirs_args(path: str, existing: set[str]) -> list[str]:
    """`--perms 0755 --dir` for each missing ancestor (bwrap would make them 0700)."""
    args = []
    parts = Path(path).parts
    for i in range(2, len(parts)):
        d = str(Path(*parts[:i]))
        if d not in existing and not d.startswith("/usr"):
            existing.add(d)
            args += ["--perms", "0755", "--dir", d]
    return args


class _Cgroups:
    """Per-command memory + pids cgroups (v1 controllers or v2 unified), if writable."""

    def __init__(self):
        self.kind = ""
        self.bases: dict[str, Path] = {}
        try:
            self._detect()
        except OSError:
            self.kind, self.bases = "", {}
        if self.bases:
            atexit.register(self._remove_bases)

    def _own_path(self, controller: str) -> str:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                return path
        return "/"

    def _detect(self):
        v1 = {c: Path("/sys/fs/cgroup") / c for c in ("memory", "pids")}
        if all((p / "cgroup.procs").exists() for p in v1.values()):
            for c, root in v1.items():
                base = root / self._own_path(c).lstrip("/") / f"c2jax-{os.getpid()}"
                base.mkdir(exist_ok=True)
                self.bases[c] = base
            self.kind = "v1"
            return
        root = Path("/sys/fs/cgroup")
        ctrl = root / "cgroup.controllers"
        if ctrl.exists() and {"memory", "pids"} <= set(ctrl.read_text().split()):
            own = self._own_path("")  # v2 line is "0::/path"
            base = root / own.lstrip("/") / f"c2jax-{os.getpid()}"
            base.mkdir(exist_ok=True)
            (base / "cgroup.subtree_control").write_text("+memory +pids")
            self.bases["unified"] = base
            self.kind = "v2"

    def _remove_bases(self):
        for base in self.bases.values():
            try:
                base.rmdir()
            except OSError:
                pass

    def create(self, memory_mb: int, max_procs: int) -> list[Path]:
        if not self.kind:
            return []
        n = next(_RUN_IDS)
        made = []
        try:
            mem = memory_mb * 1024 * 1024
            if self.kind == "v1":
                m = self.bases["memory"] / f"run{n}"
                m.mkdir()
                made.append(m)
                (m / "memory.limit_in_bytes").write_text(str(mem))
                if (m / "memory.memsw.limit_in_bytes").exists():
                    try:
                        (m / "memory.memsw.limit_in_bytes").write_text(str(mem))
                    except OSError:
                        pass
                p = self.bases["pids"] / f"run{n}"
                p.mkdir()
                made.append(p)
                (p / "pids.max").write_text(str(max_procs))
            else:
                u = self.bases["unified"] / f"run{n}"
                u.mkdir()
                made.append(u)
                (u / "memory.max").write_text(str(mem))
                (u / "memory.swap.max").write_text("0") if (u / "memory.swap.max").exists() else None
                (u / "pids.max").write_text(str(max_procs))
            return made
        except OSError:
            self.remove(made)
            return []

    def oom_killed(self, groups: list[Path]) -> bool:
        for g in groups:
            try:
                if self.kind == "v1" and (g / "memory.oom_control").exists():
                    lines = (g / "memory.oom_control").read_text().splitlines()
                    kills = [int(x.split()[1]) for x in lines if x.startswith("oom_kill ")]
                    if kills:  # page-cache reclaim also bumps failcnt: count only OOM kills
                        if kills[0] > 0:
                            return True
                    elif int((g / "memory.failcnt").read_text()) > 0:
                        return True
                elif self.kind == "v2" and (g / "memory.events").exists():
                    for line in (g / "memory.events").read_text().splitlines():
                        k, v = line.split()
                        if k == "oom_kill" and int(v) > 0:
                            return True
            except (OSError, ValueError):
                pass
        return False

    def kill_all(self, groups: list[Path]):
        for g in groups:
            try:
                for pid in (g / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            except OSError:
                pass

    def remove(self, groups: list[Path]):
        for g in groups:
            for _ in range(50):
                try:
                    g.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.kill_all([g])
                    time.sleep(0.02)


class Sandbox:
    """Runs argv inside bubblewrap with `workdir` mounted writable at /task.

    Thread-safe: run() may be called from many threads at once.
    """

    def __init__(self, limits: SandboxLimits | None = None, *,
                 python_packages: tuple[str, ...] = DEFAULT_PACKAGES, use_cgroups: bool = True,
                 block_userns: bool = True):
        self.limits = limits or SandboxLimits()
        self.bwrap = require_bwrap()
        self.as_root = os.geteuid() == 0
        self.block_userns = block_userns
        self._uids = itertools.count()
        self._uid_lock = threading.Lock()
        self.cgroups = _Cgroups() if (use_cgroups and self.as_root) else _Cgroups.__new__(_Cgroups)
        if not (use_cgroups and self.as_root):
            self.cgroups.kind, self.cgroups.bases = "", {}
        self._static_args = self._build_static_args(python_packages)

    # ----- filesystem layout -------------------------------------------------------------
    def _build_static_args(self, packages) -> list[str]:
        args = _root_entries()
        existing = {"/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc", "/tmp", "/proc", "/dev"}
        prefix = os.path.realpath(sys.base_prefix)
        ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        self.python_bin = os.path.join(prefix, "bin")
        if not prefix.startswith("/usr"):
            args += _mkdirs_args(prefix + "/x", existing)
            args += ["--ro-bind", prefix, prefix]
        site_dst = os.path.join(prefix, "lib", ver, "site-packages")
        if os.path.isdir(site_dst) and not prefix.startswith("/usr"):
            args += ["--tmpfs", site_dst]  # hide the base interpreter's own site-packages
            src_dirs = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
            for pkg in packages:
                for sd in src_dirs:
                    src = os.path.join(sd, pkg)
                    if os.path.exists(src):
                        args += ["--ro-bind", src, os.path.join(site_dst, pkg)]
                        break
        return args

    def _next_uid(self) -> int:
        with self._uid_lock:
            return UID_BASE + (os.getpid() * 7919 + next(self._uids)) % UID_POOL

    def prepare_dir(self, path: Path) -> int:
        """Gives `path` (recursively) to a fresh sandbox uid; returns the uid (root only)."""
        if not self.as_root:
            return os.geteuid()
        uid = self._next_uid()
        _chown_tree(Path(path), uid)
        return uid

    def mount_quota(self, path: Path) -> bool:
        """Mounts a `disk_mb` tmpfs on the (empty) dir `path` so a disk-filling command is capped.

        Root only; returns False (plain directory, no cap) where mounting is not possible.
        Undo with `unmount_quota`; mounts still live at interpreter exit are detached then.
        """
        if not self.as_root:
            return False
        opts = f"size={self.limits.disk_mb}m,mode=0755,nr_inodes=200000".encode()
        if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
            return False
        with _MOUNT_LOCK:
            _MOUNTS.add(str(path))
        return True

    @staticmethod
    def unmount_quota(path: Path) -> None:
        _libc().umount2(os.fsencode(path), _MNT_DETACH)
        with _MOUNT_LOCK:
            _MOUNTS.discard(str(path))

    def uid_for(self, workdir: Path) -> int:
        if not self.as_root:
            return os.geteuid()
        st = os.stat(workdir)
        if UID_BASE <= st.st_uid < UID_BASE + UID_POOL:
            return st.st_uid
        return self.prepare_dir(workdir)

    def build_argv(self, argv: list[str], workdir: Path, uid: int, cgroups: list[Path],
                   data_fds: tuple[int, int] | None = None) -> list[str]:
        """The full command line; data_fds: read ends holding /etc/passwd and /etc/group text."""
        lim = self.limits
        mb = 1024 * 1024
        cpu = max(1, round(lim.cpu_s))
        pre = ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={lim.memory_mb * mb}",
               f"--fsize={lim.file_size_mb * mb}", "--core=0", "--nofile=256",
               f"--nproc={lim.max_procs}", "--"]
        bw = [self.bwrap, "--die-with-parent", "--new-session",
              "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.as_root:
            bw += ["--unshare-user", "--disable-userns"]
        if data_fds is not None:
            bw += ["--perms", "0644", "--ro-bind-data", str(data_fds[0]), "/etc/passwd",
                   "--perms", "0644", "--ro-bind-data", str(data_fds[1]), "/etc/group"]
        bw += ["--hostname", "sandbox", *self._static_args,
               "--proc", "/proc", "--dev", "/dev",
               "--size", str(16 * mb), "--perms", "1777", "--tmpfs", "/dev/shm",
               "--size", str(lim.tmp_mb * mb), "--perms", "1777", "--tmpfs", "/tmp",
               "--bind", str(workdir), TASK_DIR, "--chdir", TASK_DIR,
               "--clearenv",
               "--setenv", "PATH", f"{self.python_bin}:/usr/local/bin:/usr/bin:/bin",
               "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
               "--setenv", "USER", "sandbox", "--setenv", "LOGNAME", "sandbox",
               "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
               "--setenv", "PYTHONUNBUFFERED", "1", "--setenv", "PYTHONNOUSERSITE", "1",
               "--"]
        drop = []
        if self.as_root:
            drop = ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
            if self.block_userns:  # an inner, unprivileged bwrap unshares the user namespace and
                # forbids nested ones (kernel attack surface); ~10-20 ms more per command
                drop += [self.bwrap, "--unshare-user", "--disable-userns", "--dev-bind", "/", "/",
                         "--die-with-parent", "--"]
        cmd = pre + bw + drop + list(argv)
        if cgroups:
            joins = "; ".join(f"echo $$ > {g}/cgroup.procs" for g in cgroups)
            cmd = ["/bin/sh", "-c", joins + '; exec "$@"', "sh"] + cmd
        return cmd

    # ----- running -----------------------------------------------------------------------
    def run(self, argv: list[str], workdir: Path, timeout_s: float | None = None,
            stdin: str | None = None) -> RunResult:
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv must be a non-empty list of str, got {argv!r}")
        if any("\0" in a for a in argv):
            return RunResult(126, "", "argument contains a NUL byte", killed_reason="")
        try:
            [os.fsencode(a) for a in argv]
        except UnicodeEncodeError:
            return RunResult(126, "", "argument is not encodable (lone surrogate)", killed_reason="")
        lim = self.limits
        wall = lim.wall_s if timeout_s is None else max(0.01, min(float(timeout_s), lim.wall_s))
        workdir = Path(workdir).resolve()
        if not workdir.is_dir():
            raise FileNotFoundError(f"sandbox workdir {workdir} does not exist")
        uid = self.uid_for(workdir)
        groups = self.cgroups.create(lim.memory_mb, lim.max_procs)
        fds = _data_fds(f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n",
                        f"root:x:0:\nsandbox:x:{uid}:\n")
        cmd = self.build_argv(argv, workdir, uid, groups, fds)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, close_fds=True, pass_fds=fds)
        except OSError as e:
            self.cgroups.remove(groups)
            return RunResult(127, "", f"sandbox failed to start: {e}", killed_reason="")
        finally:
            for fd in fds:
                os.close(fd)
        if stdin is not None:
            threading.Thread(target=_feed, args=(proc.stdin, stdin.encode("utf-8", "replace")),
                             daemon=True).start()
        out, err, truncated, reason = self._collect(proc, t0 + wall, lim.output_bytes)
        rc = proc.returncode
        if reason == "" and groups and self.cgroups.oom_killed(groups):
            reason = "memory"
        if reason == "":
            sig = rc - 128 if rc > 128 else (-rc if rc < 0 else 0)
            if sig == signal.SIGXCPU:
                reason = "cpu"
            elif sig == signal.SIGKILL:
                reason = "signal:9"
        self.cgroups.kill_all(groups)
        self.cgroups.remove(groups)
        return RunResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         timed_out=reason == "wall_clock", killed_reason=reason,
                         wall_s=time.monotonic() - t0, truncated=truncated)

    @staticmethod
    def _collect(proc, deadline: float, cap: int):
        """Reads both pipes until EOF and exit, or kills the group at the deadline / on a flood."""
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        seen = {fd: 0 for fd in bufs}
        flood = 8 * cap + (1 << 20)  # drain this much past the cap, then kill
        sel = selectors.DefaultSelector()
        for f in (proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
            sel.register(f.fileno(), selectors.EVENT_READ)
        reason = ""
        open_fds = set(bufs)
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = "wall_clock"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                seen[fd] += len(chunk)
                room = cap - len(bufs[fd])
                if room > 0:
                    bufs[fd] += chunk[:room]
            if sum(seen.values()) > flood:
                reason = "output_limit"
                break
        if reason:
            _killpg(proc)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 5)
        except subprocess.TimeoutExpired:
            _killpg(proc)
            proc.wait()
            reason = reason or "wall_clock"
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
        truncated = any(seen[fd] > len(bufs[fd]) for fd in bufs)
        keys = list(bufs)
        return bytes(bufs[keys[0]]), bytes(bufs[keys[1]]), truncated, reason


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_MOUNTS: set[str] = set()
_MOUNT_LOCK = threading.Lock()
_LIBC = []


def _libc():
    if not _LIBC:
        import ctypes
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


@atexit.register
def _unmount_all():
    for p in list(_MOUNTS):
        _libc().umount2(os.fsencode(p), _MNT_DETACH)


def _data_fds(*texts: str) -> tuple[int, ...]:
    """Read ends of pipes pre-filled with `texts` (small: they fit the pipe buffer)."""
    out = []
    for t in texts:
        r, w = os.pipe()
        os.write(w, t.encode())
        os.close(w)
        out.append(r)
    return tuple(out)


def _feed(pipe, data: bytes):
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _killpg(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _chown_tree(root: Path, uid: int):
    os.chown(root, uid, uid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)
