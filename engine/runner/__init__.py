"""The device side of a step: staging, forwards, CUDA graphs, sampling tables."""
