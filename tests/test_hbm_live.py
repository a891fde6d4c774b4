"""experiments/bench/hbm_live.py on a small hand-written dump: the temp allocation, the buffer at its
top, what is live there, and the largest sum of live buffers."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments", "bench"))
import hbm_live  # noqa: E402

MiB = 2 ** 20

BUFFERS = f"""BufferAssignment:
allocation 0: size {64 * MiB}, parameter 0, shape |f32[4096,4096]| at ShapeIndex {{}}:
 value: <1 param.0 @0> (size={64 * MiB},offset=0): f32[4096,4096]{{1,0}}
allocation 1: size {12 * MiB}, preallocated-temp:
 value: <2 fusion.1 @0> (size={8 * MiB},offset=0): f32[2048,1024]{{1,0}}
 value: <3 convert.2 @0> (size={4 * MiB},offset={8 * MiB}): bf16[2048,1024]{{1,0}}
 value: <4 add.3 @0> (size={2 * MiB},offset={8 * MiB}): f32[512,1024]{{1,0}}
"""
LIVE = """HloLiveRange (max 5):
  InstructionSequence:
    0:param.0
    1:fusion.1
    2:convert.2
    3:add.3
    4:tuple.4
  BufferLiveRange:
    param.0{}:0-4
    fusion.1{}:1-2
    convert.2{}:2-2
    add.3{}:3-4
"""


def test_reports_the_top_of_the_temp_allocation(tmp_path, capsys):
    prefix = tmp_path / "module_0000.jit_train_step.cl_1"
    (tmp_path / (prefix.name + ".after_optimizations-buffer-assignment.txt")).write_text(BUFFERS)
    (tmp_path / (prefix.name + ".after_optimizations-live-range.txt")).write_text(LIVE)
    assert hbm_live.main([str(tmp_path), "--min-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "temp allocation: 0.012 GiB" in out
    # fusion.1 and convert.2 are live together at instruction 2: 12 MiB, the largest sum
    assert "largest sum of live temp buffers: 0.012 GiB at instruction 2 (convert.2)" in out
    assert "top of the allocation: convert.2 (4.0 MiB at 0.008 GiB" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 0.")]
    assert [r.split("|")[4].strip() for r in rows] == ["fusion.1", "convert.2"]   # add.3 is not live then
    assert "param.0" not in out       # arguments are not temp
