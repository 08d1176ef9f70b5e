"""Re-quantization of routed experts (W2 / FP4 rows) and the codebook study."""
