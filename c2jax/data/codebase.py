"""Held-out codebase perplexity data (the report's "held-out loss on a real codebase").

A real repository that training never sees (by default the stdlib package `json`, which
`make_train_iterator` always adds to the corpus's exclude_packages) is read in path order;
each file is tokenized and gets EOS appended (the same document format as training) and the
files are concatenated into one stream. `rolling_windows` cuts the stream into windows of L
tokens every S tokens; each target token (every token after the first) is scored exactly
once, by the first window that contains it as a target, except that windows after the first
score only their last S positions, so every scored token has at least L - S tokens of left
context (all of it, within the first window).

Shape letters: N windows, L window length, B batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from c2jax.data.corpus import _walk_files, stdlib_dir

DEFAULT_PACKAGE = "json"


class CodebaseError(ValueError):
    pass


def load_codebase(package: str = DEFAULT_PACKAGE, root: str | None = None,
                  glob: str = "**/*.py") -> list[tuple[str, str]]:
    """[(relative name, text)] of a package under `root` (default: this Python's stdlib), sorted.

    `package` is a directory (a package or any repository) or a single module `package.py`
    under root; `root` may also be the repository itself with package="".
    """
    root = root or stdlib_dir()
    base = os.path.join(root, package) if package else root
    if os.path.isdir(base):
        rels = _walk_files(base, glob)
        names = [(f"{package}/{r}" if package else r, os.path.join(base, r)) for r in rels]
    elif os.path.isfile(base + ".py"):
        names = [(package + ".py", base + ".py")]
    else:
        raise CodebaseError(f"codebase {package!r} not found under {root!r}: set codebase_package "
                            f"to a stdlib package (e.g. 'json', 'email', 'asyncio')")
    out = []
    for name, path in sorted(names):
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            out.append((name, text))
    if not out:
        raise CodebaseError(f"codebase {package!r} under {root!r} has no UTF-8 files matching {glob!r}")
    return out


def tokenize_codebase(files: Sequence[tuple[str, str]], tokenizer, *, add_bos: bool = False,
                      max_tokens: int = 0) -> np.ndarray:
    """One int32 stream: per file ([BOS] +) ids + [EOS], in the given order; cut at max_tokens."""
    parts = []
    for ids in tokenizer.encode_batch([t for _, t in files]):
        parts.append(([tokenizer.bos_id] if add_bos else []) + ids + [tokenizer.eos_id])
    tokens = np.asarray([i for p in parts for i in p], np.int32)
    return tokens[:max_tokens] if max_tokens and max_tokens > 0 else tokens


def rolling_windows(tokens: Sequence[int] | np.ndarray, window: int, stride: int,
                    pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs_NL int32, targets_NL int32, weights_NL float32) covering a token stream.

    Window k reads tokens[k*S : k*S+L] and predicts tokens[k*S+1 : k*S+L+1]. Window 0 scores
    all its targets, window k>0 only its last S (the ones no earlier window scored), and the
    last window is padded (weight 0). Every tokens[j], j >= 1, has weight 1 exactly once.
    """
    tokens = np.asarray(tokens, np.int32)
    if not 1 <= stride <= window:
        raise CodebaseError(f"stride={stride} must be in [1, window={window}]")
    T = len(tokens)
    if T < 2:
        z = np.zeros((0, window), np.int32)
        return z, z.copy(), np.zeros((0, window), np.float32)
    n_targets = T - 1
    n_windows = 1 if n_targets <= window else 1 + -(-(n_targets - window) // stride)
    starts_N = np.arange(n_windows) * stride
    idx_NL = starts_N[:, None] + np.arange(window)[None, :]
    padded = np.concatenate([tokens, np.full(window + 1, pad_id, np.int32)])
    inputs_NL = padded[idx_NL]
    targets_NL = padded[idx_NL + 1]
    t_L = np.arange(window)
    first_scored_N = np.where(np.arange(n_windows) == 0, 0, window - stride)
    weights_NL = ((t_L[None, :] >= first_scored_N[:, None]) & (idx_NL + 1 <= T - 1)).astype(np.float32)
    inputs_NL[idx_NL >= T] = pad_id
    targets_NL[idx_NL + 1 > T - 1] = pad_id
    return inputs_NL, targets_NL, weights_NL


def codebase_eval_arrays(cfg_data: Any, tokenizer, window: int, stride: int | None = None) -> dict:
    """All windows of the configured codebase, in the training batch format (N rows).

    Keys: inputs, targets, segment_ids (1 on real tokens, 0 on padding), positions (0..L-1),
    loss_weights, plus num_scored, num_tokens (ints) and files (list of names). Mean loss =
    sum(loss_weights * nll) / num_scored. cfg_data fields used: codebase_package, codebase_root,
    codebase_glob, codebase_max_tokens, codebase_stride (stride=None: that, or window // 2),
    add_bos.
    """
    def get(k, d):
        v = cfg_data.get(k, d) if hasattr(cfg_data, "get") else getattr(cfg_data, k, d)
        return d if v is None else v

    package, root = get("codebase_package", DEFAULT_PACKAGE), get("codebase_root", "") or None
    if not package and not root:
        raise CodebaseError("set codebase_package (a stdlib package) or codebase_root (a repository)")
    files = load_codebase(package, root, get("codebase_glob", "**/*.py"))
    tokens = tokenize_codebase(files, tokenizer, add_bos=bool(get("add_bos", False)),
                               max_tokens=int(get("codebase_max_tokens", 0)))
    stride = stride or int(get("codebase_stride", 0)) or max(1, window // 2)
    inputs, targets, weights = rolling_windows(tokens, window, stride, tokenizer.pad_id)
    n = len(inputs)
    real = (np.arange(n)[:, None] * stride + np.arange(window)[None, :]) < len(tokens)
    return {
        "inputs": inputs, "targets": targets, "segment_ids": real.astype(np.int32),
        "positions": np.broadcast_to(np.arange(window, dtype=np.int32), (n, window)).copy(),
        "loss_weights": weights, "num_scored": int(weights.sum()), "num_tokens": len(tokens),
        "files": [name for name, _ in files],
    }


def iter_batches(arrays: dict, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Fixed-shape [batch_size, L] batches of the array keys; the last one padded (weight 0)."""
    keys = ("inputs", "targets", "segment_ids", "positions", "loss_weights")
    n = len(arrays["inputs"])
    for s in range(0, n, batch_size):
        batch = {}
        for k in keys:
            x = arrays[k][s:s + batch_size]
            if len(x) < batch_size:
                x = np.concatenate([x, np.zeros((batch_size - len(x),) + x.shape[1:], x.dtype)])
            batch[k] = x
        yield batch
