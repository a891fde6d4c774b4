"""experiments/bench/profile_step.py's accounting: exclusive times of nested trace events, per thread."""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module():
    sys.path.insert(0, str(ROOT / "experiments" / "bench"))
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "experiments" / "bench" / "profile_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exclusive_times_subtract_nested_events_per_thread():
    ps = _module()
    ev = lambda name, ts, dur, tid=1: {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}  # noqa: E731
    events = [
        ev("outer", 0, 100), ev("inner", 10, 30), ev("leaf", 15, 5), ev("inner2", 50, 20),
        ev("outer", 200, 10),                      # a second call of the same name adds up
        ev("other_thread", 20, 70, tid=2),         # overlaps outer in time but on another thread
        {"ph": "i", "name": "instant", "ts": 5, "pid": 1, "tid": 1},
    ]
    excl = ps.exclusive_times(events)
    assert excl == {"outer": 100 - 30 - 20 + 10, "inner": 25, "leaf": 5, "inner2": 20, "other_thread": 70}


def test_kinds_name_ffi_targets_and_strip_numbers():
    ps = _module()
    targets = {"ffi_call.12": "c2jax_expert_ffn_fwd"}
    assert ps.kind_of("ffi_call.12", targets) == "c2jax_expert_ffn_fwd"
    assert ps.kind_of("ynn_fusion.96", targets) == "ynn_fusion"
    assert ps.kind_of("ThunkExecutor::Execute (wait for completion)", targets) is None
    assert ps.kind_of("$api.py:2778 block_until_ready", targets) is None
