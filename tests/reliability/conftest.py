"""Fixtures of the fault-injection suite: one small corpus and one finished reference run
(tiny model, 4 steps, a checkpoint every step) that tests copy and damage."""
import pytest
from reliability_helpers import make_corpus, pretrain_args


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("rel_corpus"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, corpus):
    """A finished 4-step run directory (checkpoints 2, 3, 4); copy it before damaging it."""
    from c2jax.cli import main
    run = tmp_path_factory.mktemp("rel_ref") / "run"
    assert main(pretrain_args(run, corpus)) == 0
    return str(run)
