"""The tiny pod config's TPU programs (v5p:2x2x2, FSDP x CP x EP), lowered ahead of time on this
CPU machine, contain the Mosaic kernels c2jax.ops chooses for TPU: the grouped matmuls of the
experts (forward, and dX / dW in the backward) and the decode attention."""
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from c2jax.config import load_config_file  # noqa: E402
from c2jax.ops import record_choices  # noqa: E402
from c2jax.parallel import compile_check as cc  # noqa: E402
from c2jax.parallel.mesh import make_mesh  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_persistent_cache")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "pods", "tiny_v5p_8.py")


@pytest.fixture(scope="module")
def devices():
    try:
        return cc.topology_devices("v5p:2x2x2")
    except Exception as e:   # libtpu missing
        pytest.skip(f"no v5p topology: {e}")


@pytest.mark.parametrize("quant", ["none", "mxfp8"])
def test_train_step_runs_the_pallas_grouped_matmul(devices, quant):
    cfg = load_config_file(CONFIG)
    cfg.model.quant = quant
    mesh = make_mesh(cfg, devices)
    state = cc.abstract_train_state(cfg, mesh)
    with record_choices() as rec:
        text = cc.compile_train_step(cfg, mesh, state).as_text()
    assert set(rec["experts"]) == {"pallas_gmm"}
    assert rec["optimizer"] == {"optax_adamw": 1}
    # one scanned MoE layer: gate, up, down forward + dX (gmm) and dW (tgmm) for each = 9
    assert text.count("tpu_custom_call") == 9


def test_decode_step_runs_the_pallas_grouped_matmul(devices):
    cfg = load_config_file(CONFIG)
    pod = cc.pod_cfg(cfg)
    dcfg = cc._decode_cfg(cfg, pod.decode_mesh_shape, pod.decode_batch)
    lowered, _, kernels = cc.compile_decode_step(dcfg, devices, pod.decode_batch, pod.decode_len)
    assert set(kernels["experts"]) == {"pallas_gmm"}
    assert lowered.as_text().count("tpu_custom_call") == 3    # gate, up, down of the one MoE layer
