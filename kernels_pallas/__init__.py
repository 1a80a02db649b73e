"""Pallas GPU kernels on raw arrays: the floor of decodelab.

One kernel family a file. A kernel takes arrays and static parameters, never a project pytree,
so it can be read and ported on its own; it depends on jax alone. Every kernel runs compiled on a
CUDA GPU and in Pallas interpret mode on a CPU (what the test suite uses).
"""
