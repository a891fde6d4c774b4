"""`python -m c2jax eval` of a trained run's model: episodes go through the batched sampler,
eval.concurrency at a time, and the report counts every task and pass."""
import json

from reliability_helpers import cli


def test_eval_command_runs_a_trained_model(reference_run, tmp_path, capsys):
    out = tmp_path / "ev"
    rc, lines = cli(["eval", "--workdir", str(out), "--config.eval.policy=model",
                     f"--config.eval.model_run={reference_run}", "--config.eval.n_per_suite=3",
                     "--config.eval.passes=2", "--config.eval.concurrency=3", "--config.eval.max_turns=2",
                     "--config.eval.max_new_tokens=8", "--config.eval.sampler_max_len=2600"], capsys)
    assert rc == 0, lines
    report = json.loads((out / "report.json").read_text())
    rows = report["tasks"]["synthetic:1"]
    assert len(rows) == 3 and all(len(r["passed"]) == 2 for r in rows)
    assert sum(sum(r["completion_tokens"]) for r in rows) > 0, [r["finish_reason"] for r in rows]   # the model was sampled
    assert report["suites"]["synthetic:1"]["harness_exceptions"] == 0
