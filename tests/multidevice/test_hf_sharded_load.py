"""Sharded checkpoint loading on 8 fake devices with the FSDP / EP rules of the tiny v5p-8 pod
config: every device's slice callback reads exactly the bytes of its own slice from the
safetensors files (plain bf16, fp8 blocks with their scales, packed int4 with their group scales),
the loaded arrays equal an unsharded load, and a callback's transient host memory stays within a
few slices."""
import math
import os
import tracemalloc

import jax
import numpy as np
import pytest

import c2jax
from c2jax.config import load_config
from c2jax.hf import checkpoint as hf_checkpoint
from c2jax.hf import leaf_sources
from c2jax.hf.safetensors_io import SafetensorsFile
from c2jax.models import param_shardings
from c2jax.parallel import make_mesh
from c2jax.treepath import flatten_by_path

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
POD = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "pods", "tiny_v5p_8.py")


def _lengths(index, shape):
    return [len(range(*s.indices(d))) for s, d in zip(index, shape)]


def _slice_bytes(f: SafetensorsFile, prefix: str, src, leaf_shape, index) -> int:
    """On-disk bytes of the part `index` of a leaf: values at their stored width, plus the fp8
    block scales or int group scales and packed words that part covers."""
    index = tuple(index) + (slice(None),) * (len(leaf_shape) - len(index))
    rest, count = list(index), 1
    if src.layers is not None:
        count *= len(range(*rest.pop(0).indices(len(src.layers))))
    if src.experts is not None:
        count *= len(range(*rest.pop(0).indices(src.experts)))
    hf_index = list(reversed(rest)) if src.transpose else rest
    name = prefix + src.name(src.layers[0] if src.layers else None, 0 if src.experts else None)
    if name in f.entries:
        dtype, shape = f.dtype(name), f.shape(name)
        n = math.prod(_lengths(hf_index, shape)) * dtype.itemsize
        if name + "_scale_inv" in f.entries:
            (r0, r1, _), (c0, c1, _) = (s.indices(d) for s, d in zip(hf_index, shape))
            n += ((r1 - 1) // 128 - r0 // 128 + 1) * ((c1 - 1) // 128 - c0 // 128 + 1) * 4
        return n * count
    base = name.removesuffix("weight")
    rows, cols = (int(x) for x in f.read(base + "weight_shape"))
    (r0, r1, _), (c0, c1, _) = (s.indices(d) for s, d in zip(hf_index, (rows, cols)))
    words = (c1 - 1) // 8 - c0 // 8 + 1
    groups = (c1 - 1) // 32 - c0 // 32 + 1
    return ((r1 - r0) * words * 4 + (r1 - r0) * groups * 2) * count


def _pod_shardings(m):
    cfg = load_config(POD, [], validate_devices=8)
    cfg.model = m
    return param_shardings(cfg, make_mesh(cfg))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The fp8 fixture (with its MTP layer) written back as a plain bfloat16 checkpoint."""
    m, params = c2jax.hf.load(os.path.join(FIX, "deepseek_v3_tiny_fp8_mtp"))
    out = str(tmp_path_factory.mktemp("bf16"))
    c2jax.hf.save(m, params, out, dtype="bfloat16")
    return out


@pytest.mark.parametrize("which", ["bf16", "fp8", "int4"])
def test_each_device_reads_only_its_slice_bytes(which, bf16_checkpoint):
    assert jax.device_count() == 8
    path, prefix = {"bf16": (bf16_checkpoint, ""),
                    "fp8": (os.path.join(FIX, "deepseek_v3_tiny_fp8_mtp"), ""),
                    "int4": (os.path.join(FIX, "kimi_k25_tiny_int4"), "language_model.")}[which]
    m, whole = c2jax.hf.load(path)
    shardings = _pod_shardings(m)
    stats = {}
    _, params = c2jax.hf.load(path, shardings=shardings, stats=stats)
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    sources, flat_sh, flat_whole = leaf_sources(m), flatten_by_path(shardings), flatten_by_path(whole)
    reads = {}
    for key, index, nbytes in stats["reads"]:
        reads.setdefault(key, []).append((tuple((s.start, s.stop) for s in index), nbytes))
    sharded = 0
    for key, sh in flat_sh.items():
        shape = flat_whole[key].shape
        dev_index = sh.addressable_devices_indices_map(shape)
        want = sorted((tuple((s.start, s.stop) for s in idx),
                       _slice_bytes(f, prefix, sources[key], shape, idx)) for idx in dev_index.values())
        if sh.is_fully_replicated:   # JAX calls back once and copies to every device
            want = want[:1]
        else:
            sharded += 1
            full = _slice_bytes(f, prefix, sources[key], shape, ())
            assert all(b < full for _, b in want), key   # a device's slice is a strict part of the leaf
        assert sorted(reads[key]) == want, key
    assert sharded >= 20 and len(flat_sh) > sharded   # most leaves sharded, some replicated
    assert sum(b for _, _, b in stats["reads"]) <= stats["bytes_read"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, whole)


def test_callback_transient_memory_is_a_few_slices(bf16_checkpoint, monkeypatch):
    """Host memory a slice callback allocates (tracemalloc) stays within its own slice plus one HF
    matrix (bounded here by 2x the slice + 64 KiB), well below the checkpoint: nothing reads a whole
    tensor, let alone the file, per slice."""
    m, _ = c2jax.hf.load(bf16_checkpoint)
    shardings = _pod_shardings(m)
    peaks = []
    inner = hf_checkpoint._read_leaf_slice

    def measured(ckpt, src, leaf_shape, index, dtype):
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = inner(ckpt, src, leaf_shape, index, dtype)
        peaks.append((tracemalloc.get_traced_memory()[1] - before, out.nbytes))
        return out
    monkeypatch.setattr(hf_checkpoint, "_read_leaf_slice", measured)
    tracemalloc.start()
    try:
        c2jax.hf.load(bf16_checkpoint, shardings=shardings)
    finally:
        tracemalloc.stop()
    assert peaks and all(p <= 2 * s + (64 << 10) for p, s in peaks), max(peaks)
    assert max(p for p, _ in peaks) < os.path.getsize(os.path.join(bf16_checkpoint, "model.safetensors")) / 2
