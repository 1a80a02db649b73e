"""Small workloads to run under NVIDIA ``compute-sanitizer --tool memcheck`` on a GPU.

Interpret mode on a CPU cannot show a kernel reading outside its arrays; memcheck on the
compiled kernel can. Each module runs its kernels on small, ragged inputs (with the platform
allocator, so every array is its own allocation) and exits; a clean run reports 0 errors::

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        compute-sanitizer --tool memcheck python -m bench.memcheck.<name>

- ``decode``: the split-KV decode kernel and its merge.
- ``prefill``: the causal prefill kernel, through ``paged.decode_attention``.
- ``sampling``: every sampling kernel, rows of NaN included.
"""
