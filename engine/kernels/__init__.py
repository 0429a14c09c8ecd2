"""Kernels of the engine (Triton on CUDA, torch references for CPU)."""
