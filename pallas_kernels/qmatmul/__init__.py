"""Quantized matmul with fused dequantization."""
