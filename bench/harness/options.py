"""``RunOptions``: what the command line asked for (quick, dry run, tune, repeats), handed to
every suite.

A suite times its arms through ``RunOptions.time`` (JAX, ``bench/harness/timing.py``) and
``RunOptions.time_torch`` (PyTorch, ``bench/harness/torch_timing.py``) and sizes its rotating sets with
``RunOptions.num_sets_for``, so the full method and a dry run (tiny shapes, a fixed few calls,
on the CPU) go through the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from bench.harness.timing import (
    DEFAULT_REPEATS,
    DEFAULT_TARGET_SECONDS,
    TimedLoop,
    Timing,
    num_rotating_sets,
    unrolled_num_sets,
)
from bench.harness.torch_timing import time_torch_calls, torch_device_for


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What the command line asked for, handed to every suite.

    Attributes:
      quick: a subset of the standard grid.
      tune: sweep kernel parameters where a suite has them.
      dry_run: tiny shapes and few calls on the CPU, to exercise every code path; its figures
        are not speed figures.
      repeats: timed programs per figure.
      target_seconds: the length a timed program is calibrated to.
      sweep_target_seconds: the same, for sweeps of a parameter (JAX's ``k_splits``).
      dry_run_calls: calls per timed program in a dry run (no calibration).
      batches: batch sizes to run instead of a suite's grid (``--batches``), or None.
      q_len_only: the decode suite runs its multi-token cases only (``--q-len-only``).
      gumbel_only: the sampling suite skips the filtered samplers (``--gumbel-only``).
      contexts: context lengths to run instead of a suite's grid (``--contexts``), or None.
      checkpoint: called with every row measured so far, by suites that call ``save_partial``
        (``python -m bench`` writes them as a partial report), or None.
    """

    quick: bool = False
    dry_run: bool = False
    tune: bool = False
    repeats: int = DEFAULT_REPEATS
    target_seconds: float = DEFAULT_TARGET_SECONDS
    sweep_target_seconds: float = 0.05
    # Two: each of a dry run's two rotating sets (num_sets_for) visited once. Every call of an
    # interpreted kernel costs CPU time (0.15 s a call in the serving suite's step loops), and
    # a dry run's figures are not speed figures.
    dry_run_calls: int = 2
    batches: tuple[int, ...] | None = None
    q_len_only: bool = False
    gumbel_only: bool = False
    contexts: tuple[int, ...] | None = None
    checkpoint: Callable[[list], None] | None = None

    @property
    def interpret(self) -> bool:
        """Whether Pallas kernels must run in interpret mode (dry runs and machines without a
        GPU)."""
        return self.dry_run or jax.default_backend() != "gpu"

    @property
    def torch_device(self) -> str | None:
        """Where PyTorch arms run (``torch_device_for``)."""
        return torch_device_for(self.dry_run)

    def num_sets_for(self, bytes_per_set: int) -> int:
        """Rotating sets for inputs of ``bytes_per_set``: the cold-L2 count, or 2 in a dry run
        (tiny dry-run shapes would need thousands of sets and measure nothing anyway)."""
        return 2 if self.dry_run else num_rotating_sets(bytes_per_set)

    def unrolled_sets_for(self, bytes_per_set: int) -> int:
        """``num_sets_for`` capped for ``SetsInTurnLoop`` (``timing.unrolled_num_sets``); one
        set in a dry run, where every set is one more inlined (interpreted) kernel to compile
        and no figure is a speed figure."""
        return 1 if self.dry_run else unrolled_num_sets(bytes_per_set)

    def time(
        self,
        loop: TimedLoop,
        *,
        expected_us_per_call: float,
        sweep: bool = False,
        iters: int | None = None,
    ) -> Timing:
        """Times ``loop`` with these options (a fixed few calls in a dry run).

        Args:
          loop: the arm's ``TimedLoop``.
          expected_us_per_call: a prior for one call (``expected_us``).
          sweep: use ``sweep_target_seconds`` (one of many settings of a parameter).
          iters: a fixed number of calls (an arm's repeat passes its first timing's
            ``calls_per_sample``, so both time the same program).
        """
        return loop.time(
            iters=self.dry_run_calls if self.dry_run else iters,
            repeats=self.repeats,
            target_seconds=self.sweep_target_seconds if sweep else self.target_seconds,
            expected_us_per_call=expected_us_per_call,
        )

    def save_partial(self, rows: list) -> None:
        """Hands every row measured so far to ``checkpoint`` (if any). Why: one device command
        may run 600 s at most, and a suite writes its report only when it ends; a suite whose
        cases are slow to compile calls this after each group of arms, so that a run cut short
        still leaves the figures it measured (``python -m bench`` keeps them in
        ``<date>-<suite>-partial.json``, which ``bench.harness.merge_reports`` accepts)."""
        if self.checkpoint is not None and rows:
            self.checkpoint(list(rows))

    def time_torch(self, call: Callable[[int], Any], num_sets: int, device: str) -> Timing:
        """Times a PyTorch ``call`` with these options (``time_torch_calls``)."""
        return time_torch_calls(
            call,
            num_sets,
            device=device,
            repeats=self.repeats,
            target_seconds=self.target_seconds,
            calls_per_replay=self.dry_run_calls if self.dry_run else None,
        )
