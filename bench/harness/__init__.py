"""The harness: how one benchmark figure is measured and reported, shared by every suite.

The method (``docs/benchmarking.md``), implemented once so that every suite measures the same
way:

1. Count the bytes a call must move; report achieved bandwidth (bytes / median time) as a
   fraction of a device-to-device copy measured in the same run.
2. Keep the L2 cold: rotate among enough independent input sets that at least 4x the L2 is
   touched between two visits of one set.
3. Amortize dispatch: time N calls inside one jitted program (one CUDA graph for PyTorch),
   each result folded into a carried checksum so no call is dead code.
4. Warm up, repeat, take the median (report min and max); time an arm twice to see the noise.

One idea a file; this package gathers the public names of the measuring modules, so ``from
bench.harness import X`` and ``bench.harness.X`` work for all of them:

- ``timing.py``: the JAX timing method: ``num_rotating_sets`` (cold L2), ``TimedLoop``,
  ``time_in_loop``, ``Timing``, ``checksum_of``, ``expected_us``, ``calls_for``,
  ``timing_method_description`` and the constants (``DEFAULT_REPEATS``, ...).
- ``torch_timing.py``: PyTorch peers: ``time_torch_calls`` (CUDA graph, CUDA events),
  ``torch_device_for``, ``torch_from_jax``, ``release_torch_memory``.
- ``ceiling.py``: the copy ceiling: ``measure_copy_ceiling``, ``CopyCeiling``.
- ``options.py``: ``RunOptions``, what the command line asked for, through which suites time
  their arms.
- ``records.py``: ``CaseResult`` (a report row, ``CASE_FIELDS``), ``repeat_arm`` and
  ``original_arm``.

Imported by name (they import this package, so it cannot import them):

- ``bench.harness.report``: the attribution guard, the environment, progress lines, the
  Markdown and JSON reports.
- ``bench.harness.attention_inputs``: the standard attention grid and its paged KV inputs.
- ``bench.harness.merge_reports``: ``python -m bench.harness.merge_reports OUT part.json ...``,
  one report from a suite run in several processes.

Nothing here but ``attention_inputs`` knows about attention or sampling; suites in
``bench/suites/`` do.
"""

from __future__ import annotations

from bench.harness.ceiling import CopyCeiling, measure_copy_ceiling
from bench.harness.options import RunOptions
from bench.harness.records import CASE_FIELDS, REPEAT_SUFFIX, CaseResult, original_arm, repeat_arm
from bench.harness.timing import (
    COLD_L2_FACTOR,
    DEFAULT_REPEATS,
    DEFAULT_TARGET_SECONDS,
    H200_L2_BYTES,
    MAX_CALLS_PER_PROGRAM,
    MAX_ROTATING_SETS,
    SetsInTurnLoop,
    TimedLoop,
    Timing,
    calls_for,
    checksum_of,
    expected_us,
    num_rotating_sets,
    time_in_loop,
    timing_method_description,
    unrolled_num_sets,
)
from bench.harness.torch_timing import (
    release_torch_memory,
    time_torch_calls,
    torch_device_for,
    torch_from_jax,
)

__all__ = [
    "CASE_FIELDS",
    "COLD_L2_FACTOR",
    "DEFAULT_REPEATS",
    "DEFAULT_TARGET_SECONDS",
    "H200_L2_BYTES",
    "MAX_CALLS_PER_PROGRAM",
    "MAX_ROTATING_SETS",
    "REPEAT_SUFFIX",
    "CaseResult",
    "CopyCeiling",
    "RunOptions",
    "SetsInTurnLoop",
    "TimedLoop",
    "Timing",
    "calls_for",
    "checksum_of",
    "expected_us",
    "measure_copy_ceiling",
    "num_rotating_sets",
    "original_arm",
    "release_torch_memory",
    "repeat_arm",
    "time_in_loop",
    "time_torch_calls",
    "timing_method_description",
    "torch_device_for",
    "torch_from_jax",
    "unrolled_num_sets",
]
