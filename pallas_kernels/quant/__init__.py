"""Quantizers (pure jnp; XLA fuses them on every backend)."""
from pallas_kernels.quant.reference import (  # noqa: F401
    E2M1_MAX,
    E4M3_MAX,
    MX_BLOCK,
    NV_BLOCK,
    dequantize_int8,
    dequantize_mxfp8,
    dequantize_nvfp4,
    e8m0_scale_for,
    fake_quant,
    nvfp4_codes,
    quantize_int8,
    quantize_mxfp8,
    quantize_nvfp4,
)
