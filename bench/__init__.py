"""decodelab's benchmark harness and suites: ``python -m bench <suite> [--quick] [--dry-run]``.

- ``bench.harness``: the measuring method of ``benchmarking.md`` (cold L2, dispatch
  amortized in one jitted loop, median of repeats, the copy ceiling) and ``CaseResult``.
- ``bench.report``: the attribution guard, the environment, the Markdown and JSON reports.
- ``bench.attention_inputs``: the standard attention grid and its paged KV inputs.
- ``bench.suites``: the suites (``peers``, ...) and the contract a suite follows.

This package imports nothing heavy at import time, so the command line can choose JAX's
platform before JAX starts.
"""
