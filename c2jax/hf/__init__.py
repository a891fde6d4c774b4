"""Hugging Face interop for `qwen3_moe` and `deepseek_v3` (Kimi K2 uses the DeepSeek-V3 layout;
Kimi K2.5's `kimi_k25` wrapper is read for its text model).

`load(dir)` reads config.json and the safetensors files (single or sharded with
model.safetensors.index.json) lazily: each parameter is assembled with
`jax.make_array_from_callback`, so a device (or host) reads only the byte ranges of the tensors it
holds under the target sharding. Checkpoints stored as fp8 blocks (DeepSeek-V3, Kimi K2) or with
pack-quantized int4 experts (Kimi K2-Thinking, K2.5) are dequantized once at load (c2jax.hf.quant
says why); other quantization formats are refused by name. `save(cfg, params, dir)` writes the
legacy per-expert layout that transformers and other tools load, plain or in either quantized
format, MTP heads as DeepSeek-V3's extra layers. Formats and examples: docs/CHECKPOINTS.md.
"""
from c2jax.config import ConfigError
from c2jax.hf.checkpoint import load, save
from c2jax.hf.config import SUPPORTED, config_from_hf, config_to_hf
from c2jax.hf.errors import CheckpointError
from c2jax.hf.names import LeafSource, leaf_sources

__all__ = ["load", "save", "config_from_hf", "config_to_hf", "CheckpointError", "ConfigError", "SUPPORTED",
           "LeafSource", "leaf_sources"]
