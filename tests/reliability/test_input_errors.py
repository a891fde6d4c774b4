"""Bad inputs fail in one line that names the file (and line) and says what to do, before any
checkpoint is read or any file written: corrupt safetensors headers, bad chats, a config file
with a syntax error, an unknown eval suite, unwritable workdirs."""
import errno
import json
import os
import shutil
import struct

import pytest
from reliability_helpers import cli, pretrain_args

from c2jax.hf.errors import CheckpointError
from c2jax.hf.safetensors_io import SafetensorsFile, write_file

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "deepseek_v3_tiny_fp8_mtp")


@pytest.mark.parametrize("header", [
    struct.pack("<Q", 2 ** 63 + 5) + b"{}",                            # a length past any file (was OverflowError)
    struct.pack("<Q", 12) + b"{not json!!}",
    struct.pack("<Q", 16) + b'{"w": [1, 2, 3]}',                       # JSON, but not tensor entries
    b"\x01\x02",                                                        # shorter than the length field
])
def test_corrupt_safetensors_header_names_the_file(tmp_path, capsys, header):
    hf_dir = tmp_path / "hf"
    shutil.copytree(FIX, hf_dir)
    path = hf_dir / "model.safetensors"
    path.write_bytes(header)
    with pytest.raises(CheckpointError, match=f"^{path}: "):
        SafetensorsFile(str(path))
    rc, lines = cli(["convert", "--from", "hf", str(hf_dir), "--to", str(tmp_path / "run")], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error (CheckpointError): {path}: "), lines
    assert not (tmp_path / "run").exists()


def test_intact_safetensors_still_read(tmp_path):
    import numpy as np
    write_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(tmp_path / "x.safetensors"))
    f = SafetensorsFile(str(tmp_path / "x.safetensors"))
    assert f.read("a").tolist() == [[0, 1, 2], [3, 4, 5]]
    f.close()


@pytest.mark.parametrize("line,message", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
     "message 1 has role='robot': use one of ['assistant', 'system', 'tool', 'user']"),
    ({"messages": ["just text"]}, "each message must be a JSON object with 'role' and 'content'"),
    ("{not json", "expected a JSON object with 'messages'"),
])
def test_bad_chat_names_file_and_line_before_any_restore(reference_run, corpus, tmp_path, capsys, monkeypatch,
                                                         line, message):
    import c2jax.train.loop as loop
    chats = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "add two"}, {"role": "assistant", "content": "a + b"}]}
    chats.write_text(json.dumps(good) + "\n\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")

    def restore(*a, **k):
        raise AssertionError("the init checkpoint was read before the SFT data was checked")
    monkeypatch.setattr(loop, "load_run_params", restore)
    run = tmp_path / "sft"
    args = pretrain_args(run, corpus, extra=[f"--config.train.init_from={reference_run}",
                                             f"--config.data.sft_path={chats}"])
    rc, lines = cli(["sft", *args[1:]], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (PipelineError): {chats}:3: {message}"), lines
    assert not (run / "config.json").exists()
    rc, lines = cli(["sft", *args[1:-1], f"--config.data.sft_path={tmp_path / 'missing.jsonl'}"], capsys)
    assert rc == 2 and lines == [f"error (PipelineError): data.sft_path={str(tmp_path / 'missing.jsonl')!r}: "
                                 "no such file"]


def test_config_file_with_a_syntax_error(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(arg=None):\n    return {\n")
    rc, lines = cli(["pretrain", "--config", str(bad), "--workdir", str(tmp_path / "run")], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"config error: {bad}:2: syntax error: "), lines
    assert not (tmp_path / "run").exists()


def test_unknown_eval_suite(tmp_path, capsys):
    rc, lines = cli(["eval", "--workdir", str(tmp_path / "ev"), "--config.eval.suites=('nope',)"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: eval.suites / eval.split: unknown task suite 'nope'; available: ")


def test_unwritable_workdir(corpus, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc, lines = cli(pretrain_args(blocker / "run", corpus), capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error (ENOTDIR) at {blocker / 'run'}: a path component is not a directory")
    real = os.makedirs

    def read_only(path, *a, **k):     # (the tests may run as root, whom permissions do not stop)
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *a, **k)
    monkeypatch.setattr(os, "makedirs", read_only)
    rc, lines = cli(pretrain_args(tmp_path / "ro" / "run", corpus), capsys)
    assert rc == 2 and lines == [f"error (EROFS) at {tmp_path / 'ro' / 'run'}: read-only file system: choose a "
                                 "writable path (e.g. another --workdir)"]
    rc, lines = cli(["--debug", *pretrain_args(tmp_path / "ro" / "run", corpus)], capsys)
    assert rc == 2 and lines[0] == "Traceback (most recent call last):" and lines[-1].startswith("error (EROFS)")
