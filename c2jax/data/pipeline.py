"""grain pipelines: packed pretraining rows and packed SFT chats.

Every batch is a dict of numpy arrays (B = per-process batch, L = seq_len):
    inputs        int32[B, L]   token ids (PAD on padding)
    targets       int32[B, L]   the next token of the same document (PAD where there is none)
    segment_ids   int32[B, L]   1..n per row, one per document piece; 0 = padding
    positions     int32[B, L]   0.. within each segment (restart at every segment)
    loss_weights  float32[B, L] 1 where `targets` is a real next token to learn, else 0

Pretraining (`make_train_iterator`): each document is tokenized and gets EOS appended; the
split's documents are concatenated in corpus order into one token stream (cached on disk as
.npy, keyed by corpus + tokenizer hash) and cut into rows of L tokens, so long documents run on
across rows and no row has padding except the very last. A document cut by a row end keeps
its true next token as the target of its last position in that row (weight 1); the weight is
0 only on a document's final token (its EOS) and on padding. Rows are shuffled (seeded,
reshuffled every epoch), assigned round-robin to processes (process p takes global rows p,
p+P, ...) and batched, so global batch k is rows [k*B*P, (k+1)*B*P) of the global order.
With a finite `num_epochs` the global order is padded with all-padding rows to a whole number
of global batches, so every process yields the same number of batches and every token is an
input exactly once per epoch.

SFT (`make_sft_iterator`): chats are rendered by `render_chat` (role token + content +
END_TURN per message), packed whole (first fit, truncated to L if longer), with weight 1 only
where the target is an assistant token (its content and its END_TURN).

Iterators are grain `DatasetIterator`s; `get_state()` is a small JSON-able dict, and
`set_state()` on a freshly made iterator with the same arguments resumes at the same batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from absl import logging

from c2jax import special_tokens
from c2jax.data.corpus import Corpus, CorpusSpec, build_corpus

CACHE_FORMAT = "c2jax-tokens-v1"
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_weights")


class PipelineError(ValueError):
    pass


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        v = cfg.get(key, default)
    else:
        v = getattr(cfg, key, default)
    return default if v is None else v


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "c2jax", "tokens")


# ---------------------------------------------------------------------------------------------
# Tokenized corpus cache


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """A split as one token stream: document d is tokens[doc_offsets[d]:doc_offsets[d+1]]."""

    path: str  # directory holding tokens.npy, doc_offsets.npy, meta.json
    num_tokens: int
    num_docs: int

    def tokens(self) -> np.ndarray:
        return np.load(os.path.join(self.path, "tokens.npy"), mmap_mode="r")

    def doc_offsets(self) -> np.ndarray:
        return np.load(os.path.join(self.path, "doc_offsets.npy"))


def tokenize_split(corpus: Corpus, split: str, tokenizer, cache_dir: str | None = None, *,
                   add_bos: bool = False, chunk_docs: int = 256) -> TokenizedSplit:
    """Tokenizes a split (each doc: [BOS] + ids + [EOS]) once; later calls reuse the cache."""
    cache_dir = cache_dir or default_cache_dir()
    key = hashlib.sha256("\n".join([CACHE_FORMAT, corpus.fingerprint(split), tokenizer.fingerprint(),
                                    f"bos={add_bos}"]).encode()).hexdigest()[:24]
    out = os.path.join(cache_dir, f"{split}-{key}")
    meta_path = os.path.join(out, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        return TokenizedSplit(out, meta["num_tokens"], meta["num_docs"])

    docs = corpus.split(split)
    if not docs:
        raise PipelineError(f"split {split!r} has no documents (corpus stats: {corpus.stats.as_dict()})")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    eos, bos = tokenizer.eos_id, tokenizer.bos_id
    parts, lengths = [], []
    for start in range(0, len(docs), chunk_docs):
        for ids in tokenizer.encode_batch([d.text for d in docs[start:start + chunk_docs]]):
            arr = np.asarray(([bos] if add_bos else []) + ids + [eos], dtype=dtype)
            parts.append(arr)
            lengths.append(len(arr))
    tokens = np.concatenate(parts)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])

    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{split}-{key}.", dir=cache_dir)
    try:
        np.save(os.path.join(tmp, "tokens.npy"), tokens)
        np.save(os.path.join(tmp, "doc_offsets.npy"), offsets)
        meta = {"format": CACHE_FORMAT, "split": split, "num_tokens": len(tokens),
                "num_docs": len(docs), "vocab_size": tokenizer.vocab_size, "add_bos": add_bos,
                "corpus_stats": corpus.stats.as_dict()}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TokenizedSplit(out, len(tokens), len(docs))


# ---------------------------------------------------------------------------------------------
# Random-access row sources (picklable: arrays are opened lazily in each worker)


def _padding_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    return {
        "inputs": np.full(seq_len, pad_id, np.int32), "targets": np.full(seq_len, pad_id, np.int32),
        "segment_ids": np.zeros(seq_len, np.int32), "positions": np.zeros(seq_len, np.int32),
        "loss_weights": np.zeros(seq_len, np.float32),
    }


class PackedRows:
    """Row i = stream tokens [i*L, (i+1)*L) with segment ids, positions, targets and weights."""

    def __init__(self, split: TokenizedSplit, seq_len: int, pad_id: int):
        self.path, self.seq_len, self.pad_id = split.path, seq_len, pad_id
        self.num_tokens = split.num_tokens
        self._arr = None

    def __len__(self) -> int:
        return (self.num_tokens + self.seq_len - 1) // self.seq_len

    def __getstate__(self):
        return {**self.__dict__, "_arr": None}

    def _arrays(self):
        arr = self._arr  # one attribute, assigned once: safe with grain's reader threads
        if arr is None:
            arr = (np.load(os.path.join(self.path, "tokens.npy"), mmap_mode="r"),
                   np.load(os.path.join(self.path, "doc_offsets.npy")))
            self._arr = arr
        return arr

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        L = self.seq_len
        row = _padding_row(L, self.pad_id)
        if i < 0:  # an all-padding row (fills the last global batch)
            return row
        tok, off = self._arrays()
        s, e = i * L, min((i + 1) * L, self.num_tokens)
        n = e - s
        idx = np.arange(s, e)
        doc = np.searchsorted(off, idx, side="right") - 1
        has_next = idx + 1 < off[doc + 1]
        nxt = np.asarray(tok[s + 1:min(e + 1, self.num_tokens)], np.int32)
        if len(nxt) < n:
            nxt = np.concatenate([nxt, np.full(n - len(nxt), self.pad_id, np.int32)])
        row["inputs"][:n] = tok[s:e]
        row["targets"][:n] = np.where(has_next, nxt, self.pad_id)
        row["segment_ids"][:n] = doc - doc[0] + 1
        row["positions"][:n] = idx - np.maximum(off[doc], s)
        row["loss_weights"][:n] = has_next
        return row


class _OrderedRows:
    """k -> rows[order[k]] for k < total, an all-padding row past it (grain map transform)."""

    def __init__(self, order: grain.MapDataset, total: int, rows):
        self.order, self.total, self.rows = order, total, rows

    def __call__(self, k: int):
        return self.rows[int(self.order[k])] if k < self.total else self.rows[-1]


def _shard_options(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    if shard_index is None or shard_count is None:
        import jax

        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise PipelineError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    return shard_index, shard_count


def rows_to_iterator(rows, *, batch_size: int, seed: int, shuffle: bool = True,
                     num_epochs: int | None = None, shard_index: int | None = None,
                     shard_count: int | None = None, read_threads: int = 1,
                     prefetch: int = 4) -> grain.DatasetIterator:
    """Shuffles / repeats / shards / batches a random-access row source (len, [i], [-1]=padding).

    `batch_size` is the GLOBAL batch; each process gets batch_size // shard_count rows.
    """
    shard_index, shard_count = _shard_options(shard_index, shard_count)
    if batch_size <= 0 or batch_size % shard_count:
        raise PipelineError(f"batch_size={batch_size} must be a positive multiple of the number "
                            f"of processes ({shard_count})")
    if num_epochs is not None and num_epochs <= 0:
        raise PipelineError(f"num_epochs={num_epochs} must be positive or None (forever)")
    n = len(rows)
    if n == 0:
        raise PipelineError("no rows to iterate over")
    order = grain.MapDataset.range(n)
    if shuffle:
        order = order.shuffle(seed=int(seed) % 2**32)  # grain reseeds every epoch (seed + epoch)
    order = order.repeat(num_epochs)
    if num_epochs is None:
        total = padded = sys.maxsize
    else:
        total = n * num_epochs
        padded = -(-total // batch_size) * batch_size
    ds = grain.MapDataset.range(padded)[shard_index::shard_count]
    ds = ds.map(_OrderedRows(order, total, rows))
    ds = ds.batch(batch_size // shard_count, drop_remainder=True)
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch))
    return iter(it_ds)


# ---------------------------------------------------------------------------------------------
# Pretraining


def corpus_spec_from_config(cfg_data: Any) -> CorpusSpec:
    """Corpus fields of the data config; the perplexity codebase is always excluded."""
    corpus_cfg = _cfg_get(cfg_data, "corpus", cfg_data)
    return CorpusSpec.from_config(corpus_cfg if corpus_cfg is not None else {},
                                  extra_exclude=[_cfg_get(cfg_data, "codebase_package", "")])


def load_corpus_and_tokenizer(cfg_data: Any, run_dir: str | None):
    """(corpus, tokenizer) for a run: the tokenizer is reloaded from run_dir/tokenizer.json if
    there, else imported from cfg_data.tokenizer_path or trained on the train split and saved."""
    from c2jax.data.tokenizer import load_or_train_tokenizer

    corpus = build_corpus(corpus_spec_from_config(cfg_data))
    tok = load_or_train_tokenizer(
        run_dir, corpus, vocab_size=int(_cfg_get(cfg_data, "vocab_size", 8192)),
        sample_mb=float(_cfg_get(cfg_data, "tokenizer_sample_mb", 16.0)),
        tokenizer_path=_cfg_get(cfg_data, "tokenizer_path", ""))
    logging.info("corpus %s; tokenizer %s", corpus.stats.as_dict(), tok)
    return corpus, tok


def make_train_iterator(cfg_data: Any, tokenizer, seq_len: int, batch_size: int, seed: int, *,
                        split: str = "train", num_epochs: int | None = None,
                        shuffle: bool | None = None, shard_index: int | None = None,
                        shard_count: int | None = None, corpus: Corpus | None = None,
                        cache_dir: str | None = None) -> grain.DatasetIterator:
    """Iterator over packed [batch_size // processes, seq_len] batches of a corpus split.

    cfg_data: the data config (c2jax.data.config.get_config() fields: corpus, codebase_package,
      cache_dir, add_bos, read_threads) or a dict with the same keys; `corpus` skips the build.
    batch_size: the global batch; this process gets batch_size // shard_count rows per batch.
    split: "train" (shuffled, forever by default) or "heldout" (set num_epochs=1, shuffle=False
      for an eval pass).
    shard_index / shard_count: default jax.process_index() / jax.process_count().
    """
    if seq_len <= 0:
        raise PipelineError(f"seq_len={seq_len} must be positive")
    corpus = corpus or build_corpus(corpus_spec_from_config(cfg_data))
    tsplit = tokenize_split(corpus, split, tokenizer,
                            cache_dir or _cfg_get(cfg_data, "cache_dir", "") or None,
                            add_bos=bool(_cfg_get(cfg_data, "add_bos", False)))
    rows = PackedRows(tsplit, seq_len, tokenizer.pad_id)
    return rows_to_iterator(
        rows, batch_size=batch_size, seed=seed,
        shuffle=(split == "train") if shuffle is None else shuffle, num_epochs=num_epochs,
        shard_index=shard_index, shard_count=shard_count,
        read_threads=int(_cfg_get(cfg_data, "read_threads", 1)))


# ---------------------------------------------------------------------------------------------
# SFT

ROLE_TOKENS = {
    "system": special_tokens.SYSTEM, "user": special_tokens.USER,
    "assistant": special_tokens.ASSISTANT, "tool": special_tokens.TOOL_RESULT,
}


def render_chat(messages: Sequence[Mapping[str, Any]], tokenizer) -> tuple[list[int], list[int]]:
    """[BOS] + per message: role token + content + END_TURN.

    Returns (ids, trained): trained[t] = 1 where ids[t] is produced by the assistant (its content
    and its END_TURN; not its role token, which the prompt supplies). Replaceable by the agent
    harness's own chat format: anything returning the same pair works with `pack_sft`.
    """
    ids = [tokenizer.bos_id]
    trained = [0]
    end = tokenizer.token_id(special_tokens.END_TURN)
    contents = tokenizer.encode_batch([str(m.get("content") or "") for m in messages])
    for i, (m, content) in enumerate(zip(messages, contents)):
        role = m.get("role")
        if role not in ROLE_TOKENS:
            raise PipelineError(f"message {i} has role={role!r}: use one of {sorted(ROLE_TOKENS)}")
        is_asst = int(role == "assistant")
        ids += [tokenizer.token_id(ROLE_TOKENS[role])] + content + [end]
        trained += [0] + [is_asst] * (len(content) + 1)
    return ids, trained


@dataclasses.dataclass
class SFTStats:
    chats: int = 0
    rows: int = 0
    truncated: int = 0        # chats longer than seq_len (cut to seq_len)
    skipped_no_assistant: int = 0
    tokens: int = 0
    trained_tokens: int = 0


class SFTRows:
    """Whole chats packed first-fit into rows of L tokens; row i is built on access."""

    def __init__(self, chats: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
                 seed: int = 0, open_rows: int = 64):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.stats = SFTStats(chats=len(chats))
        order = np.random.default_rng(seed).permutation(len(chats))  # mixes lengths across rows
        rows: list[list[int]] = []
        free: list[int] = []
        self.ids, self.trained = [], []
        for c in order:
            ids, trained = chats[c]
            if not any(trained[1:]):
                self.stats.skipped_no_assistant += 1
                continue
            if len(ids) > seq_len:
                self.stats.truncated += 1
                ids, trained = ids[:seq_len], trained[:seq_len]
            k = len(self.ids)
            self.ids.append(np.asarray(ids, np.int32))
            self.trained.append(np.asarray(trained, np.float32))
            self.stats.tokens += len(ids)
            self.stats.trained_tokens += int(sum(trained[1:]))
            lo = max(0, len(rows) - open_rows)
            for r in range(lo, len(rows)):
                if free[r] >= len(ids):
                    rows[r].append(k)
                    free[r] -= len(ids)
                    break
            else:
                rows.append([k])
                free.append(seq_len - len(ids))
        self.rows = rows
        self.stats.rows = len(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        row = _padding_row(self.seq_len, self.pad_id)
        if i < 0:
            return row
        p = 0
        for seg, k in enumerate(self.rows[i], 1):
            ids, tr = self.ids[k], self.trained[k]
            n = len(ids)
            row["inputs"][p:p + n] = ids
            row["targets"][p:p + n - 1] = ids[1:]
            row["segment_ids"][p:p + n] = seg
            row["positions"][p:p + n] = np.arange(n)
            row["loss_weights"][p:p + n - 1] = tr[1:]
            p += n
        return row


def token_record(tokens, loss_mask, **extra) -> str:
    """One pre-tokenized SFT JSONL line as read_chats_jsonl reads it: {"tokens", "loss_mask"} (ints)
    plus any extra JSON fields (ignored by the reader), newline-terminated."""
    ids, mask = [int(t) for t in tokens], [int(bool(m)) for m in loss_mask]
    if len(ids) != len(mask):
        raise ValueError(f"tokens ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    return json.dumps({"tokens": ids, "loss_mask": mask, **extra}) + "\n"


def read_chats_jsonl(path: str) -> list:
    """Chats (lists of messages) or pre-tokenized (ids, mask) tuples, one per JSONL line."""
    return [chat for _, chat in read_chats_lines(path)]


def read_chats_lines(path: str) -> list:
    """(line number, chat) for each non-empty line of a chats JSONL (as read_chats_jsonl)."""
    chats = []
    if not os.path.isfile(path):
        raise PipelineError(f"data.sft_path={path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if isinstance(obj, dict) and "tokens" in obj:
                    ids, mask = [int(t) for t in obj["tokens"]], [int(bool(m)) for m in obj["loss_mask"]]
                    if len(ids) != len(mask):
                        raise ValueError("tokens and loss_mask differ in length")
                    chats.append((lineno, (ids, mask)))
                    continue
                msgs = obj["messages"]
            except (ValueError, KeyError, TypeError) as e:
                raise PipelineError(f"{path}:{lineno}: expected a JSON object with 'messages' ({e})") from e
            if not isinstance(msgs, list):
                raise PipelineError(f"{path}:{lineno}: 'messages' must be a list")
            chats.append((lineno, msgs))
    if not chats:
        raise PipelineError(f"{path}: no chats")
    return chats


def make_sft_iterator(jsonl_path: str, tokenizer, seq_len: int, batch_size: int, seed: int, *,
                      num_epochs: int | None = None, shuffle: bool = True,
                      shard_index: int | None = None, shard_count: int | None = None,
                      render=render_chat, read_threads: int = 1) -> grain.DatasetIterator:
    """Iterator over packed SFT batches from JSONL lines {"messages": [{"role", "content"}]}, or
    pre-tokenized lines {"tokens": [...], "loss_mask": [...]} (the agent harness's exact token
    format, e.g. oracle transcripts; loss_mask marks the model's tokens)."""
    chats = []
    for lineno, item in read_chats_lines(jsonl_path):
        if isinstance(item, tuple):
            chats.append(item)
            continue
        try:
            if not all(isinstance(m, Mapping) for m in item):
                raise PipelineError("each message must be a JSON object with 'role' and 'content'")
            chats.append(render(item, tokenizer))
        except PipelineError as e:
            raise PipelineError(f"{jsonl_path}:{lineno}: {e}") from None
    rows = SFTRows(chats, seq_len, tokenizer.pad_id, seed=seed)
    logging.info("SFT data %s: %s", jsonl_path, dataclasses.asdict(rows.stats))
    if len(rows) == 0:
        raise PipelineError(f"{jsonl_path}: no chat has an assistant message to train on")
    return rows_to_iterator(rows, batch_size=batch_size, seed=seed, shuffle=shuffle,
                            num_epochs=num_epochs, shard_index=shard_index,
                            shard_count=shard_count, read_threads=read_threads)
