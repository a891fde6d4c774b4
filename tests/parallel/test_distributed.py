"""Two local processes (jax.distributed on CPU, 4 fake devices each) train the tiny model with
CP and EP spanning both processes and match a single-process run's losses: the CPT step, and the
RL learner step (reference KL, router replay)."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from c2jax.config import ConfigError
from c2jax.parallel import distributed

WORKER = os.path.join(os.path.dirname(__file__), "_train_worker.py")
RL_WORKER = os.path.join(os.path.dirname(__file__), "_rl_worker.py")


def _env(devices, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("C2JAX_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **extra)
    return env


def _losses(stdout):
    line = [ln for ln in stdout.splitlines() if ln.startswith("LOSSES ")][-1]
    return json.loads(line[len("LOSSES "):])


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("worker", [WORKER, RL_WORKER], ids=["cpt", "rl"])
def test_two_processes_match_single_process(worker):
    args = ["mla", "2,1,2,2"]                 # data 2 x context 2 x expert 2 over 8 devices in 2 processes
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, worker, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(4, C2JAX_COORDINATOR=f"localhost:{port}",
                                                  C2JAX_NUM_PROCESSES="2", C2JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    single = subprocess.run([sys.executable, worker, "mla", "1,1,1,1"], capture_output=True, text=True,
                            env=_env(1), timeout=400, check=False)
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    multi, ref = _losses(outs[0][0]), _losses(single.stdout)
    assert multi["num_processes"] == 2 and multi["devices"] == 8 and multi["local_devices"] == 4
    assert len(multi["losses"]) == 3
    np.testing.assert_allclose(multi["losses"], ref["losses"], rtol=2e-5)


def test_initialize_explains_missing_flags(monkeypatch):
    monkeypatch.setenv("C2JAX_COORDINATOR", "localhost:1234")
    monkeypatch.delenv("C2JAX_NUM_PROCESSES", raising=False)
    with pytest.raises(ConfigError, match="process count"):
        distributed.initialize()
