"""Weight sync: the learner publishes policy versions; samplers fetch and swap them in flight.

Across processes / hosts a version travels as a lossless *delta* against the previous one:
for every leaf, the flat indices whose bit pattern changed (delta-coded uint32) and their new
values, zlib-compressed; every `full_every` versions (and for version 0) a full snapshot is
published instead, so a late subscriber never replays a long chain. Decoding reproduces the
new weights bit for bit (NaN payloads and -0.0 included): values are compared and copied as
raw bits.

In one process (the threads backend) the sampler takes the learner's arrays directly; the
publisher still measures delta vs full size when asked, so the numbers are logged either way.
"""
from __future__ import annotations

import io
import json
import os
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _path_key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def flatten(params) -> dict[str, np.ndarray]:
    """{"a/b/c": host array} of a params pytree."""
    return {_path_key(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def unflatten_like(template, flat: dict[str, np.ndarray]):
    """A pytree shaped like `template` with leaves from `flat` (same keys as flatten)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[_path_key(p)] for p, _ in paths])


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(_UINT[a.dtype.itemsize])


def _pack(arrays: dict[str, np.ndarray], header: dict, level: int) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    body = zlib.compress(buf.getvalue(), level)
    h = json.dumps(header).encode()
    return len(h).to_bytes(4, "little") + h + body


def _unpack(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    n = int.from_bytes(blob[:4], "little")
    header = json.loads(blob[4:4 + n])
    with np.load(io.BytesIO(zlib.decompress(blob[4 + n:]))) as z:
        arrays = {k: z[k] for k in z.files}
    return header, arrays


def encode_full(flat: dict[str, np.ndarray], version: int, level: int = 1) -> bytes:
    arrays = {f"{i}": np.ascontiguousarray(v) for i, v in enumerate(flat.values())}
    header = {"kind": "full", "version": version, "keys": list(flat),
              "shapes": [list(v.shape) for v in flat.values()], "dtypes": [v.dtype.name for v in flat.values()]}
    return _pack(arrays, header, level)


def encode_delta(prev: dict[str, np.ndarray], new: dict[str, np.ndarray], version: int, level: int = 1
                 ) -> tuple[bytes, dict]:
    """Lossless delta prev -> new. Returns (blob, stats{changed, total})."""
    if list(prev) != list(new):
        raise ValueError("encode_delta: the two versions have different parameter trees")
    arrays, changed, total = {}, 0, 0
    for i, (k, a) in enumerate(new.items()):
        p = prev[k]
        if p.shape != a.shape or p.dtype != a.dtype:
            raise ValueError(f"encode_delta: leaf {k} changed shape/dtype {p.shape}{p.dtype} -> {a.shape}{a.dtype}")
        nb, pb = _bits(a), _bits(p)
        idx = np.flatnonzero(nb != pb).astype(np.uint32)
        total += nb.size
        changed += idx.size
        if idx.size:
            gaps = np.diff(idx, prepend=np.uint32(0)).astype(np.uint32)  # small numbers compress well
            arrays[f"{i}i"] = gaps
            arrays[f"{i}v"] = nb[idx]
    header = {"kind": "delta", "version": version, "keys": list(new)}
    return _pack(arrays, header, level), {"changed": changed, "total": total}


def _as_dtype(a: np.ndarray, name: str) -> np.ndarray:
    """a as dtype `name` (a name, e.g. "bfloat16", or a numpy type string); the archive returns
    ml_dtypes' types (bfloat16, float8) as raw void bytes, which are reinterpreted, not converted."""
    dt = np.dtype(jnp.dtype(name)) if not name.startswith(("<", ">", "|")) else np.dtype(name)
    return a.view(dt) if a.dtype.kind == "V" else a.astype(dt, copy=False)


def apply_blob(prev: dict[str, np.ndarray] | None, blob: bytes) -> tuple[int, dict[str, np.ndarray]]:
    """Decode a full or delta blob (delta: onto prev). Returns (version, flat params)."""
    header, arrays = _unpack(blob)
    if header["kind"] == "full":
        flat = {k: _as_dtype(arrays[f"{i}"].reshape(header["shapes"][i]), header["dtypes"][i])
                for i, k in enumerate(header["keys"])}
        return header["version"], flat
    if prev is None:
        raise ValueError(f"delta for version {header['version']} needs the previous version")
    out = {}
    for i, k in enumerate(header["keys"]):
        p = prev[k]
        if f"{i}i" not in arrays:
            out[k] = p
            continue
        bits = _bits(p).copy()
        idx = np.cumsum(arrays[f"{i}i"].astype(np.uint64)).astype(np.int64)
        bits[idx] = arrays[f"{i}v"]
        out[k] = bits.view(p.dtype).reshape(p.shape)
    return header["version"], out


class WeightPublisher:
    """Publishes versions as full snapshots / deltas, into `directory` (cross-process) or only
    measured (directory None). `publish` returns size stats for the metrics."""

    def __init__(self, directory: str | None, full_every: int = 10, sync_dtype: str = "float32", keep: int = 0):
        self.directory, self.full_every, self.sync_dtype = directory, max(int(full_every), 1), sync_dtype
        self.keep = keep
        self.prev: dict[str, np.ndarray] | None = None
        self.prev_version: int | None = None
        if directory:
            os.makedirs(directory, exist_ok=True)

    def cast(self, params):
        if self.sync_dtype == "float32":
            return params
        import jax.numpy as jnp
        dt = jnp.dtype(self.sync_dtype)
        return jax.tree.map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)

    def publish(self, version: int, params) -> dict:
        flat = flatten(self.cast(params))
        full_bytes = sum(a.nbytes for a in flat.values())
        full = self.prev is None or version % self.full_every == 0 or self.prev_version != version - 1
        if full:
            blob = encode_full(flat, version)
            stats = {"sync/full": 1, "sync/changed_fraction": 1.0}
        else:
            blob, st = encode_delta(self.prev, flat, version)
            stats = {"sync/full": 0, "sync/changed_fraction": st["changed"] / max(st["total"], 1)}
        stats.update({"sync/blob_bytes": len(blob), "sync/full_bytes": full_bytes,
                      "sync/delta_ratio": len(blob) / max(full_bytes, 1)})
        if self.directory:
            name = os.path.join(self.directory, f"v{version:08d}.{'full' if full else 'delta'}")
            with open(name + ".tmp", "wb") as f:
                f.write(blob)
            os.replace(name + ".tmp", name)
            self._gc(version)
        self.prev, self.prev_version = flat, version
        return stats

    def _gc(self, version):
        if not self.keep:
            return
        files = sorted(os.listdir(self.directory))
        fulls = [f for f in files if f.endswith(".full") and int(f[1:9]) <= version]
        if len(fulls) > self.keep:
            cutoff = int(fulls[-self.keep][1:9])
            for f in files:
                if not f.endswith(".tmp") and int(f[1:9]) < cutoff:
                    os.remove(os.path.join(self.directory, f))


class WeightSubscriber:
    """Reads the newest version from a publisher's directory: the latest full snapshot, then
    every delta after it (only the new ones on later calls)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.version: int | None = None
        self.flat: dict[str, np.ndarray] | None = None
        self._lock = threading.Lock()

    def latest_version(self) -> int | None:
        files = [f for f in os.listdir(self.directory) if f.endswith((".full", ".delta"))]
        return max((int(f[1:9]) for f in files), default=None)

    def fetch(self) -> tuple[int | None, dict[str, np.ndarray] | None]:
        with self._lock:
            files = sorted(f for f in os.listdir(self.directory) if f.endswith((".full", ".delta")))
            if not files:
                return None, None
            by_v = {int(f[1:9]): f for f in files}
            newest = max(by_v)
            if self.version == newest:
                return self.version, self.flat
            start = self.version
            chain_ok = start is not None and all(v in by_v for v in range(start + 1, newest + 1))
            if not chain_ok:
                fulls = [v for v, f in by_v.items() if f.endswith(".full")]
                start = max(fulls)
                with open(os.path.join(self.directory, by_v[start]), "rb") as f:
                    _, self.flat = apply_blob(None, f.read())
                self.version = start
            for v in range(self.version + 1, newest + 1):
                with open(os.path.join(self.directory, by_v[v]), "rb") as f:
                    _, self.flat = apply_blob(self.flat, f.read())
                self.version = v
            return self.version, self.flat
