"""decodelab's benchmark harness and suites: ``python -m bench <suite> [--quick] [--tune]
[--dry-run]``.

- ``bench.harness``: the measuring method of ``benchmarking.md`` in one import, re-exported from
  ``bench.timing`` (cold L2, dispatch amortized in one jitted loop, median of repeats),
  ``bench.torch_timing`` (PyTorch arms in CUDA graphs), ``bench.ceiling`` (the copy ceiling),
  ``bench.options`` (``RunOptions``) and ``bench.records`` (``CaseResult``).
- ``bench.report``: the attribution guard, the environment, the Markdown and JSON reports.
- ``bench.attention_inputs``: the standard attention grid and its paged KV inputs.
- ``bench.suites``: the suites (``peers``, ``decode``) and the contract a suite follows.
- ``bench.memcheck_decode``: a small decode workload for ``compute-sanitizer``; ``run_on_gpu.sh``:
  the stages one GPU session runs.

This package imports nothing heavy at import time, so the command line can choose JAX's
platform before JAX starts.
"""
