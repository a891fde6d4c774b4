"""A machine without bubblewrap or a C++ compiler fails the test run, saying how to fix it,
unless C2JAX_ALLOW_MISSING names what is missing."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest_without_tools(tmp_path, allow: str | None):
    env = {k: v for k, v in os.environ.items() if k not in ("C2JAX_ALLOW_MISSING", "CXX")}
    env["PATH"] = str(tmp_path)  # no bwrap, no g++ (the interpreter is called by its path)
    env["PYTHONPATH"] = str(ROOT)
    if allow is not None:
        env["C2JAX_ALLOW_MISSING"] = allow
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--co", "-p", "no:cacheprovider",
                           "tests/test_config.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_missing_bwrap_fails_the_session_with_the_fix(tmp_path):
    r = _pytest_without_tools(tmp_path, None)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "apt-get install -y bubblewrap" in out and "apt-get install -y g++" in out
    assert "C2JAX_ALLOW_MISSING" in out


def test_opting_out_lets_the_session_run(tmp_path):
    r = _pytest_without_tools(tmp_path, "bwrap,cpu_kernels")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = _pytest_without_tools(tmp_path, "bwrap")
    assert r.returncode != 0 and "g++" in r.stdout + r.stderr and "bubblewrap" not in r.stdout + r.stderr
    r = _pytest_without_tools(tmp_path, "bwrap,gpu")
    assert r.returncode != 0 and "unknown dependencies ['gpu']" in r.stdout + r.stderr
