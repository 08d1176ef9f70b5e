"""Compute kernels. Each has a torch reference (reference.py) with the signature the Triton
kernels implement; CPU always runs the reference."""
