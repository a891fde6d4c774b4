"""Lossless delta weight sync: bit-exact round trips, sparse updates give small deltas, full
snapshots every N versions, a subscriber that joins late or skips versions."""
import numpy as np
import pytest

from c2jax.rl.weight_sync import WeightPublisher, WeightSubscriber, apply_blob, encode_delta, encode_full, flatten


def _params(rng):
    return {"layer": {"w": rng.standard_normal((64, 32)).astype(np.float32),
                      "b": np.zeros((32,), np.float32)},
            "embed": rng.standard_normal((100, 16)).astype(np.float32),
            "half": rng.standard_normal((8, 8)).astype(np.float16)}


def _equal_bits(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert a[k].tobytes() == b[k].tobytes(), k


def test_delta_roundtrip_is_bit_exact_with_special_values():
    rng = np.random.default_rng(0)
    p0 = flatten(_params(rng))
    p1 = {k: v.copy() for k, v in p0.items()}
    p1["layer/w"][3, 4] = np.nan
    p1["layer/w"][0, 0] = -0.0
    p1["layer/b"][5] = np.inf
    p1["embed"] += np.float32(1e-7) * (rng.random(p1["embed"].shape) < 0.02)
    blob, st = encode_delta(p0, p1, 1)
    v, back = apply_blob(p0, blob)
    assert v == 1
    _equal_bits(back, p1)
    assert 0 < st["changed"] < st["total"]
    v, full = apply_blob(None, encode_full(p1, 1))
    _equal_bits(full, p1)


def test_sparse_update_delta_is_much_smaller_than_full():
    rng = np.random.default_rng(1)
    pub = WeightPublisher(None, full_every=100)
    p = _params(rng)
    s0 = pub.publish(0, p)
    assert s0["sync/full"] == 1
    p["layer"]["w"] = p["layer"]["w"].copy()
    p["layer"]["w"][:2] += 1.0  # ~2% of the weights change
    s1 = pub.publish(1, p)
    assert s1["sync/full"] == 0 and s1["sync/changed_fraction"] < 0.05
    assert s1["sync/blob_bytes"] * 10 < s1["sync/full_bytes"]


@pytest.mark.parametrize("join_late", [False, True])
def test_publisher_subscriber_chain(tmp_path, join_late):
    rng = np.random.default_rng(2)
    pub = WeightPublisher(str(tmp_path), full_every=3)
    sub = WeightSubscriber(str(tmp_path))
    p = _params(rng)
    kinds = []
    for v in range(7):
        p = {"layer": {"w": p["layer"]["w"] + (rng.random((64, 32)) < 0.1).astype(np.float32),
                       "b": p["layer"]["b"]}, "embed": p["embed"], "half": p["half"]}
        kinds.append(pub.publish(v, p)["sync/full"])
        if not join_late or v >= 5:
            ver, flat = sub.fetch()
            assert ver == v
            _equal_bits(flat, flatten(p))
    assert kinds == [1, 0, 0, 1, 0, 0, 1]
