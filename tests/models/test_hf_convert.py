"""`python -m c2jax convert`: HF -> c2jax run directory (orbax) -> HF, quantized tensors bit-exact."""
import json
import os

import numpy as np

from c2jax.cli import main
from c2jax.hf.safetensors_io import SafetensorsFile

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "deepseek_v3_tiny_fp8_mtp")


def _tensors(path):
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    return {k: f.read(k) for k in f.keys()}


def test_convert_round_trip(tmp_path, capsys):
    run, back = str(tmp_path / "run"), str(tmp_path / "back")
    assert main(["convert", "--from", "hf", FIX, "--to", run]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert summary["quant"] == "fp8" and summary["mtp_layers"] == 1
    assert "load [##############################]" in out.err          # the progress bar reached the end
    assert os.path.isdir(os.path.join(run, "checkpoints", "0")) and os.path.exists(os.path.join(run, "config.json"))
    assert main(["convert", "--from", "orbax", run, "--to", back, "--quantize", "fp8", "--dtype", "bfloat16"]) == 0
    orig, ours = _tensors(FIX), _tensors(back)
    assert sorted(orig) == sorted(ours)
    for k, v in orig.items():
        np.testing.assert_array_equal(ours[k].view(np.uint8), v.view(np.uint8), err_msg=k)


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert main(["convert", "--from", "hf", str(tmp_path), "--to", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["convert", "--from", "orbax", str(tmp_path), "--to", str(tmp_path / "y")]) == 2
    assert "not a c2jax run directory" in capsys.readouterr().err
