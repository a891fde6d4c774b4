"""Damaged checkpoint directories, without training: truncated and deleted files fall back to the
newest intact step (reported with step, file and cause); trees that do not match the target fail
in one line and never restore partially."""
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.errors import CheckpointMismatch, CheckpointUnreadable
from c2jax.failures import one_line
from c2jax.train.checkpoint import Checkpointer, abstract_like


def _state(step):
    k = jax.random.key(step)
    return {"params": {"w": jax.random.normal(k, (64, 32)), "b": jnp.full((32,), float(step))},
            "opt_state": {"mu": {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}, "count": jnp.int32(step)},
            "step": jnp.int32(step)}


@pytest.fixture
def ckpt_dir(tmp_path):
    d = str(tmp_path / "checkpoints")
    c = Checkpointer(d, every=1, keep=5, async_save=False)
    for s in (1, 2, 3):
        c.save(s, _state(s), {"iterator": {"pos": s}}, {"step": s})
    c.close()
    return d


def _restore(d, target=None, quarantine=False):
    c = Checkpointer(d, every=1, keep=5, async_save=False)
    target = target or abstract_like(_state(0))
    try:
        return c.restore_intact(lambda s: c.restore(s, target), quarantine=quarantine)
    finally:
        c.close()


def _data_files(step_dir):
    out = []
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        out += [os.path.join(root, f) for f in files if os.sep + "d" + os.sep in os.path.join(root, f) + os.sep]
    return sorted(out, key=os.path.getsize)


def _one_line(exc_info):
    msg = one_line(exc_info.value)
    assert msg is not None and "\n" not in msg
    return msg


def test_truncated_newest_step_falls_back_with_a_warning(ckpt_dir, caplog):
    for f in _data_files(os.path.join(ckpt_dir, "3")):
        with open(f, "r+b") as fh:
            fh.truncate(max(os.path.getsize(f) // 3, 1))
    with caplog.at_level(logging.WARNING):
        step, (state, data, meta) = _restore(ckpt_dir, quarantine=True)
    assert step == 2 and data == {"iterator": {"pos": 2}} and meta == {"step": 2}
    np.testing.assert_array_equal(state["params"]["w"], _state(2)["params"]["w"])
    warning = next(r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage())
    assert warning.startswith("checkpoint step 3 cannot be restored (" + os.path.join(ckpt_dir, "3"))
    # The unreadable step is moved aside, so that the resumed run can save step 3 again.
    assert sorted(os.listdir(ckpt_dir)) == ["1", "2"]
    assert os.listdir(ckpt_dir + ".corrupt")[0].startswith("3-")
    c = Checkpointer(ckpt_dir, every=1, keep=5, async_save=False)
    c.save(3, _state(3), {"iterator": {"pos": 3}}, {"step": 3})
    c.close()
    assert _restore(ckpt_dir)[0] == 3


@pytest.mark.parametrize("victim", ["state/_METADATA", "state/manifest.ocdbt", "data/metadata"])
def test_deleted_file_is_named_and_the_previous_step_used(ckpt_dir, caplog, victim):
    os.remove(os.path.join(ckpt_dir, "3", victim))
    with caplog.at_level(logging.WARNING):
        step, _ = _restore(ckpt_dir)
    assert step == 2
    assert any(f"{os.path.join(ckpt_dir, '3', victim)} is missing" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(ckpt_dir)) == ["1", "2", "3"]     # without quarantine nothing moves


def test_no_intact_step_is_one_clear_error(ckpt_dir):
    for s in (1, 2, 3):
        os.remove(os.path.join(ckpt_dir, str(s), "state", "manifest.ocdbt"))
    with pytest.raises(CheckpointUnreadable) as e:
        _restore(ckpt_dir, quarantine=True)
    msg = _one_line(e)
    assert msg.startswith(f"error (CheckpointUnreadable): no checkpoint in {ckpt_dir} can be restored")
    assert all(f"step {s}: {os.path.join(ckpt_dir, str(s), 'state', 'manifest.ocdbt')} is missing" in msg
               for s in (1, 2, 3))
    assert sorted(os.listdir(ckpt_dir)) == ["1", "2", "3"]     # nothing is moved when nothing restores


def test_other_shape_is_refused_not_restored_partially(ckpt_dir):
    target = abstract_like(_state(0))
    target["params"]["w"] = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    with pytest.raises(CheckpointMismatch) as e:
        _restore(ckpt_dir, target)
    assert "params/w: float32[64, 32] in the checkpoint, float32[32, 32] here" in _one_line(e)
    # Only params restored (as init_from and convert do): still checked leaf for leaf.
    c = Checkpointer(ckpt_dir, every=1, keep=5, async_save=False, create=False)
    with pytest.raises(CheckpointMismatch, match="params/b: float32"):
        c.restore_params(3, {"w": target["params"]["w"], "b": jax.ShapeDtypeStruct((32,), jnp.bfloat16)})
    c.close()


def test_other_optimizer_state_tree_is_refused(ckpt_dir):
    target = abstract_like(_state(0))
    target["opt_state"]["nu"] = target["opt_state"]["mu"]
    del target["opt_state"]["count"]
    with pytest.raises(CheckpointMismatch) as e:
        _restore(ckpt_dir, target)
    msg = _one_line(e)
    assert "opt_state/count in the checkpoint but not in this config's tree" in msg
    assert "opt_state/nu/w missing from the checkpoint" in msg


def test_read_only_open_of_a_missing_directory_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        Checkpointer(str(tmp_path / "nope" / "checkpoints"), every=1, keep=1, create=False)
    assert not (tmp_path / "nope").exists()
