"""Raw safetensors access: parse the header, read a slice of one tensor with positioned reads of
only the bytes it covers, write a file. Unlike safetensors.numpy this handles bfloat16 and float8
(via ml_dtypes) and counts the bytes read, so sharded loads can prove each reader's traffic."""
from __future__ import annotations

import json
import os
import struct
import threading

import ml_dtypes
import numpy as np

from c2jax.hf.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


class ReadCounter:
    """Bytes read from safetensors files, in total and per open read scope (thread-local), so a
    caller can attribute the reads of one slice (one device's callback) to it."""

    def __init__(self):
        self.total = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n
        for scope in getattr(self._local, "scopes", ()):
            scope[0] += n

    def scope(self):
        """Context manager yielding a one-element list that accumulates the bytes read inside it."""
        counter = self

        class _Scope:
            def __enter__(self):
                self.box = [0]
                counter._local.scopes = getattr(counter._local, "scopes", ()) + (self.box,)
                return self.box

            def __exit__(self, *exc):
                counter._local.scopes = tuple(s for s in counter._local.scopes if s is not self.box)
        return _Scope()


COUNTER = ReadCounter()   # every SafetensorsFile reports here


class SafetensorsFile:
    """One .safetensors file: header parsed once, tensor slices read with os.pread."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror}") from e
        head = os.pread(self._fd, 8, 0)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(self._fd).st_size
        if n > size - 8:
            os.close(self._fd)
            raise CheckpointError(f"{path}: corrupt safetensors header (it claims {n} bytes of a {size}-byte "
                                  f"file); re-download or re-export this file")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            for name, e in header.items():
                if name != "__metadata__" and not (isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)):
                    raise ValueError(f"entry {name!r} lacks dtype/shape/data_offsets")
        except (ValueError, UnicodeDecodeError) as e:
            os.close(self._fd)
            raise CheckpointError(f"{path}: corrupt safetensors header ({e}); re-download or re-export this "
                                  f"file") from e
        self.metadata = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self.entries = {}
        for name, e in header.items():
            if e["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {e['dtype']}")
            self.entries[name] = (DTYPES[e["dtype"]], tuple(e["shape"]), self._base + e["data_offsets"][0])

    def keys(self):
        return self.entries.keys()

    def dtype(self, name) -> np.dtype:
        return self.entries[name][0]

    def shape(self, name) -> tuple[int, ...]:
        return self.entries[name][1]

    def read(self, name, index=None) -> np.ndarray:
        """The tensor, or its part `index` (a tuple of slices, one per leading axis at most),
        reading only the byte runs that part covers."""
        dtype, shape, start = self.entries[name]
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        ranges = [s.indices(d) for s, d in zip(index, shape)]
        if any(step != 1 for _, _, step in ranges):
            full = self.read(name, tuple(slice(a, b) for a, b, _ in ranges))
            return full[tuple(slice(None, None, st) for _, _, st in ranges)]
        out_shape = tuple(max(0, b - a) for a, b, _ in ranges)
        out = np.empty(out_shape, dtype)
        if out.size == 0:
            return out
        # Axes after the last partial one are whole: each run is contiguous over them.
        partial = [i for i, (a, b, _) in enumerate(ranges) if (a, b) != (0, shape[i])]
        k = partial[-1] if partial else -1
        strides = [int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize for i in range(len(shape))]
        run = (out_shape[k] if k >= 0 else 1) * (strides[k] if k >= 0 else int(np.prod(shape)) * dtype.itemsize)
        flat = out.reshape(-1).view(np.uint8)
        pos = 0
        for outer in np.ndindex(*out_shape[:max(k, 0)]):
            off = start + sum((ranges[i][0] + j) * strides[i] for i, j in enumerate(outer))
            off += ranges[k][0] * strides[k] if k >= 0 else 0
            chunk = os.pread(self._fd, run, off)
            if len(chunk) != run:
                raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
            flat[pos:pos + run] = np.frombuffer(chunk, np.uint8)
            pos += run
        COUNTER.add(pos)
        return out

    def close(self):
        os.close(self._fd)


def write_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None) -> None:
    """Write tensors (any dtype in DTYPES, incl. bfloat16 / float8) as one safetensors file."""
    header, offset = {}, 0
    order = sorted(tensors)
    for name in order:
        a = tensors[name]
        if a.dtype not in NAMES:
            raise CheckpointError(f"cannot write tensor {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())   # little-endian hosts
