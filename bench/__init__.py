"""decodelab's benchmarks: ``python -m bench <suite> [--quick] [--tune] [--dry-run]``.

One folder a kind of script:

- ``bench.harness``: how a figure is measured and reported, shared by everything below:
  timing (cold L2, dispatch amortized in one jitted loop, median of repeats), PyTorch timing,
  the copy ceiling, ``RunOptions``, ``CaseResult``, the report writer and its attribution
  guard, the standard attention inputs, and ``python -m bench.harness.merge_reports`` (one
  report from a suite run in parts).
- ``bench.suites``: the suites ``python -m bench <suite>`` runs, each writing
  ``docs/benchmark_results/<date>-<suite>.{md,json}``, and the contract a suite follows.
- ``bench.tuning``: launch-parameter sweeps that chose kernels' defaults.
- ``bench.probes``: one-off measurements that answered a design question.
- ``bench.memcheck``: small workloads for ``compute-sanitizer``.
- ``bench.quality``: quality studies, what an approximation costs a trained model (measured on
  a CPU with the references; reports in ``docs/quality/``, not ``docs/benchmark_results/``).
- ``bench/run_on_gpu.sh``: the stages one GPU session runs.

The method is described in ``docs/benchmarking.md``. This package imports nothing heavy at
import time, so the command line can choose JAX's platform before JAX starts.
"""
