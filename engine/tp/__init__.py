"""Tensor parallelism: the process group, the per-step channel, the worker ranks."""
