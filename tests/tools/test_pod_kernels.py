"""The tiny pod config's TPU programs (v5p:2x2x2, FSDP x CP x EP), lowered ahead of time on this
CPU machine, contain the Mosaic kernels c2jax.ops chooses for TPU, counted per kernel: the grouped
matmuls of the experts (forward, and dX / dW in the backward; their MXFP8 forms under quant),
flash attention as the CP ranks' local attention (forward, dQ, dK/dV), and in the sampler's jitted
decode chunk the grouped matmuls and the decode attention kernel (GQA's, or MLA's in the latent
space). One scanned MoE layer and
one dense layer: a loop body's calls count once."""
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from c2jax.config import load_config_file  # noqa: E402
from c2jax.ops import record_choices  # noqa: E402
from c2jax.tools import compile_check as cc  # noqa: E402
from c2jax.parallel.mesh import make_mesh  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_persistent_cache")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "pods", "tiny_v5p_8.py")
FLASH = {"_fwd_kernel": 2, "_dq_kernel": 2, "_dkv_kernel": 2}     # both layers' attention


@pytest.fixture(scope="module")
def devices():
    try:
        return cc.topology_devices("v5p:2x2x2")
    except Exception as e:   # libtpu missing
        pytest.skip(f"no v5p topology: {e}")


def _gmm(quant: str, fwd: int, dw: int) -> dict:
    q = "q" if quant != "none" else ""
    return {f"_{q}gmm_kernel": fwd, **({f"_{q}tgmm_kernel": dw} if dw else {})}


@pytest.mark.parametrize("attention,quant", [("mla", "none"), ("mla", "mxfp8"), ("gqa", "none")])
def test_train_step_runs_flash_attention_and_the_grouped_matmul(devices, attention, quant):
    cfg = load_config_file(f"{CONFIG}:{attention}")
    cfg.model.quant = quant
    mesh = make_mesh(cfg, devices)
    state = cc.abstract_train_state(cfg, mesh)
    with record_choices() as rec:
        text = cc.compile_train_step(cfg, mesh, state).as_text()
    # EP 4 (data x context): the grouped matmul on each device's experts, rows moved by all-to-all
    assert set(rec["experts"]) == {"ep_all_to_all(pallas_gmm)"} and set(rec["attention"]) == {"pallas_flash"}
    assert set(rec[f"{attention}_attention"]) == {"context_parallel"}
    assert rec["optimizer"] == {"optax_adamw": 1}
    # gate and up joined, then down (EP: one [D, 2F] product on the local experts), forward + their
    # dX (gmm) and dW (tgmm)
    assert cc.mosaic_kernels(text) == {**FLASH, **_gmm(quant, 4, 2)}


@pytest.mark.parametrize("attention,quant", [("mla", "none"), ("mla", "mxfp8"), ("gqa", "none")])
def test_sampler_decode_chunk_runs_the_mosaic_kernels(devices, attention, quant):
    cfg = load_config_file(f"{CONFIG}:{attention}")
    cfg.model.quant = quant
    pod = cc.pod_cfg(cfg)
    dcfg = cc._decode_cfg(cfg, pod.decode_mesh_shape, pod.decode_batch)
    lowered, _, kernels = cc.compile_decode_step(dcfg, devices, pod.decode_batch, pod.decode_len)
    assert set(kernels["experts"]) == {"ep_all_to_all(pallas_gmm)"}     # EP 2 over data
    assert set(kernels["decode_layout"]) == {"quantized" if quant != "none" else "float"}
    assert set(kernels[f"{attention}_attention"]) == {"cache_decode" if attention == "gqa" else "latent_cache"}
    text = lowered.as_text()
    assert "stablehlo.while" in text   # the chunk's on-device loop, not a single forward
    want = _gmm(quant, 2, 0)       # gate and up joined, then down
    if attention == "gqa":
        want["_decode_kernel"] = 2
        assert set(kernels["decode_attention"]) == {"pallas"}
    else:   # MLA attends the latent cache in place
        want["_mla_decode_kernel"] = 2
        assert set(kernels["mla_cache_attention"]) == {"pallas"}
    assert cc.mosaic_kernels(text) == want


def test_ragged_ep_exchange_compiles_to_tpu_ragged_all_to_all(devices):
    """mesh.ep_exchange="ragged" on TPU: the EP exchange is XLA's ragged all-to-all (rows out,
    expert ids out, results back, and their transposes in the backward pass), not the dense
    all_to_all the CPU form uses, and the grouped matmuls still run."""
    cfg = load_config_file(f"{CONFIG}:gqa")
    cfg.mesh.ep_exchange = "ragged"
    mesh = make_mesh(cfg, devices)
    state = cc.abstract_train_state(cfg, mesh)
    lowered = cc.compile_train_step(cfg, mesh, state)
    text = lowered.as_text()
    assert cc.mosaic_kernels(text) == {**FLASH, **_gmm("none", 4, 2)}
    # forward: rows out, expert ids out, results back; backward: the two row exchanges transposed
    assert text.count("ragged_all_to_all") == 5
    assert "ragged-all-to-all-start" in lowered.compile().as_text()   # TPU runs it as an async collective
