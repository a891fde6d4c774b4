"""Lazy, quantization-aware tensor access over a checkpoint directory (one or many safetensors
files): `read(name, index)` returns the float32 (or stored-dtype) part `index` of a logical
weight, dequantizing fp8 blocks or packed ints from only the bytes that part covers."""
from __future__ import annotations

import json
import os

import numpy as np

from c2jax.hf import quant
from c2jax.hf.errors import CheckpointError
from c2jax.hf.safetensors_io import SafetensorsFile

TEXT_PREFIXES = ("", "language_model.", "model.language_model.")


def _range(index_item, size: int) -> range:
    start, stop, step = index_item.indices(size)
    if step != 1:
        raise CheckpointError(f"internal: strided read {index_item} of a quantized weight")
    return range(start, stop)


class Checkpoint:
    """The tensors of one checkpoint directory, under the text model's name prefix."""

    def __init__(self, path: str, scheme: quant.Scheme, wrapped: bool = False):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            weight_map = {k: "model.safetensors" for k in SafetensorsFile(single).keys()}
        else:
            raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.path, self.weight_map, self.scheme, self._files, self._shapes = path, weight_map, scheme, {}, {}
        self.prefix = ""
        if wrapped:
            found = [p for p in TEXT_PREFIXES if p + "model.embed_tokens.weight" in weight_map]
            if not found:
                raise CheckpointError(f"{path}: no text model tensors (model.embed_tokens.weight under any of "
                                      f"{[p for p in TEXT_PREFIXES if p]})")
            self.prefix = found[0]
        # Tensors outside the text model (a vision tower, a projector): skipped, counted by top-level name.
        self.skipped: dict[str, int] = {}
        for k in weight_map:
            if not k.startswith(self.prefix):
                top = k.split(".")[0]
                self.skipped[top] = self.skipped.get(top, 0) + 1

    def _file(self, full: str) -> SafetensorsFile:
        fname = self.weight_map[full]
        if fname not in self._files:
            fpath = os.path.join(self.path, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"{self.path}: shard {fname} (holding {full!r}) is missing")
            self._files[fname] = SafetensorsFile(fpath)
        return self._files[fname]

    def has(self, name: str) -> bool:
        return self.prefix + name in self.weight_map or self._packed(name) in self.weight_map

    def _packed(self, name: str) -> str:
        return self.prefix + name.removesuffix("weight") + "weight_packed"

    def kind(self, name: str) -> str:
        """How `name` is stored: "fp8" (with block scales), "int" (packed) or "plain"."""
        full = self.prefix + name
        if full in self.weight_map:
            if self._file(full).dtype(full) == quant.FP8:
                if full + "_scale_inv" not in self.weight_map:
                    raise CheckpointError(f"{self.path}: fp8 tensor {name!r} has no {name}_scale_inv")
                if self.scheme.method != "fp8":
                    raise CheckpointError(f"{self.path}: fp8 tensor {name!r} but config.json has no fp8 "
                                          "quantization_config (quant_method 'fp8', weight_block_size)")
                return "fp8"
            return "plain"
        if self._packed(name) in self.weight_map:
            if self.scheme.method not in ("int4", "int8"):
                raise CheckpointError(f"{self.path}: packed tensor {self._packed(name)!r} but config.json has no "
                                      "compressed-tensors quantization_config")
            return "int"
        raise CheckpointError(f"{self.path}: tensor {self.prefix + name!r} is missing from the checkpoint")

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical (dequantized) shape of weight `name` (remembered: a packed weight's is read once)."""
        if name not in self._shapes:
            self._shapes[name] = self._shape(name)
        return self._shapes[name]

    def _shape(self, name: str) -> tuple[int, ...]:
        kind = self.kind(name)
        if kind != "int":
            full = self.prefix + name
            return self._file(full).shape(full)
        base = self._packed(name).removesuffix("_packed")
        if base + "_shape" in self.weight_map:
            return tuple(int(x) for x in self._file(base + "_shape").read(base + "_shape"))
        rows, _ = self._file(base + "_packed").shape(base + "_packed")
        return rows, self._file(base + "_scale").shape(base + "_scale")[1] * self.scheme.group_size

    def read(self, name: str, index=None) -> np.ndarray:
        """The part `index` (slices over the logical [out, in] or 1-D shape) of weight `name`,
        dequantized to float32 if it is stored quantized."""
        kind = self.kind(name)
        full = self.prefix + name
        if kind == "plain":
            return self._file(full).read(full, index)
        shape = self.shape(name)
        index = tuple(index or ()) + (slice(None),) * (2 - len(index or ()))
        rows, cols = _range(index[0], shape[0]), _range(index[1], shape[1])
        if kind == "fp8":
            b0, b1 = self.scheme.block
            sname = full + "_scale_inv"
            want = (-(-shape[0] // b0), -(-shape[1] // b1))
            if self._file(sname).shape(sname) != want:
                raise CheckpointError(f"{self.path}: {sname!r} has shape {list(self._file(sname).shape(sname))}, "
                                      f"expected {list(want)} for {b0}x{b1} blocks of {list(shape)}")
            if not len(rows) or not len(cols):
                return np.zeros((len(rows), len(cols)), np.float32)
            q = self._file(full).read(full, (slice(rows.start, rows.stop), slice(cols.start, cols.stop)))
            s = self._file(sname).read(sname, (slice(rows.start // b0, (rows.stop - 1) // b0 + 1),
                                               slice(cols.start // b1, (cols.stop - 1) // b1 + 1)))
            return quant.fp8_dequantize(q, s, (b0, b1), rows, cols)
        bits, group = self.scheme.num_bits, self.scheme.group_size
        per = 32 // bits
        base = self._packed(name).removesuffix("_packed")
        pname, sname = base + "_packed", base + "_scale"
        if self._file(sname).shape(sname) != (shape[0], -(-shape[1] // group)):
            raise CheckpointError(f"{self.path}: {sname!r} has shape {list(self._file(sname).shape(sname))}, "
                                  f"expected {[shape[0], -(-shape[1] // group)]} (groups of {group})")
        if not len(rows) or not len(cols):
            return np.zeros((len(rows), len(cols)), np.float32)
        w0, w1 = cols.start // per, (cols.stop - 1) // per + 1
        words = self._file(pname).read(pname, (slice(rows.start, rows.stop), slice(w0, w1)))
        vals = quant.unpack_int(words, bits, (w1 - w0) * per)[:, cols.start - w0 * per:cols.stop - w0 * per]
        s = self._file(sname).read(sname, (slice(rows.start, rows.stop),
                                           slice(cols.start // group, (cols.stop - 1) // group + 1)))
        return quant.int_dequantize(vals, s, group, cols)

    def unused(self, used: set[str]) -> list[str]:
        """Text-model tensors that no param was read from (scales and packing parts excluded)."""
        aux = ("_scale_inv", "_scale", "_shape", "_packed", "_zero_point", "_g_idx")
        out = []
        for k in self.weight_map:
            if not k.startswith(self.prefix):
                continue
            name = k[len(self.prefix):]
            base = next((name[: -len(a)] for a in aux if name.endswith(a)), None)
            if name not in used and not (base is not None and (base in used or base + "weight" in used)):
                out.append(name)
        return sorted(out)
