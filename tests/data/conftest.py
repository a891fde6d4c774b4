import os

import pytest

from c2jax.data.tokenizer import sample_texts, train_tokenizer

_TEXT = '''def add(a, b):
    """Adds two numbers."""
    return a + b


class Point:
    def __init__(self, x: float, y: float) -> None:
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
'''


def make_files(root, n=24, seed=0):
    """n small Python-ish files of varied length under root (some long enough to span rows)."""
    import random

    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        lines = [f"# file {i}"] + [f"x_{i}_{j} = {rng.randint(0, 999)}  # é {j}" for j in range(rng.randint(1, 60))]
        with open(os.path.join(root, f"m{i:02d}.py"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n" + _TEXT * rng.randint(0, 2))
    return root


@pytest.fixture(scope="session")
def files_factory():
    return make_files


@pytest.fixture(scope="session")
def tiny_tokenizer():
    texts = [_TEXT * 3, "x_1_2 = 345  # é 7\n" * 50, "import os\nprint('héllo wörld')\n" * 20]
    return train_tokenizer(sample_texts(enumerate(texts), 1.0), vocab_size=512, min_frequency=1)
