import textwrap

import pytest

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    "import os\n\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n        yield root, files\n",
]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A small code corpus directory (60 files) for fast training tests."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(60):
        body = SNIPPETS[i % 3].replace("add", f"add_{i}").replace("Stack", f"Stack{i}")
        (root / f"mod_{i}.py").write_text(textwrap.dedent(body) * (1 + i % 4))
    return str(root)


def small_overrides(corpus_dir, steps=6, extra=()):
    """CLI overrides for a fast tiny training run over small_corpus."""
    return [
        f"--config.data.corpus.sources=[{{'kind': 'dir', 'path': {corpus_dir!r}}}]",
        "--config.data.vocab_size=512", "--config.data.codebase_max_tokens=512",
        "--config.data.corpus.heldout_fraction=0.1",
        f"--config.data.cache_dir={corpus_dir.rstrip('/')}_token_cache",
        "--config.model.vocab_size=512", "--config.model.hidden_size=32", "--config.model.num_layers=2",
        "--config.model.intermediate_size=64", "--config.model.moe_intermediate_size=32",
        "--config.model.head_dim=8", f"--config.train.steps={steps}", "--config.train.batch_size=4",
        "--config.train.seq_len=32", "--config.train.eval_every=0", "--config.train.checkpoint_every=1",
        "--config.train.eval_batches=1", "--config.train.log_every=1", "--config.train.peak_flops=1e11",
        "--config.train.warmup_steps=2", *extra,
    ]
