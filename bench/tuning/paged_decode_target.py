"""What ``python -m bench tune paged_decode`` tunes: the paged decode kernel's launch
(``pages_per_step``, ``num_warps``, ``num_stages``), by shape bucket.

- Bucket key: ``head_dim`` and ``group_rows`` (the query-head group padded to the 16-row tile)
  exactly, ``batch`` and ``context`` rounded up to powers of two. Why batch and context: they
  decide the plan (whether requests are split, how long the chunks are), which is what the
  hand-kept table of ``kernels_pallas/paged_decode_tuning.py`` keys on (``write_final``,
  ``long_chunks``); a bucket is measured at its own shape (``batch x context`` of the key).
- Default: the launch the kernel uses today for that bucket's plan
  (``paged.decode.decode_launch_parameters``, i.e. the hand-kept table), so a tuned entry must
  beat what ships.
- Candidates: the decode suite's sweep (``bench.suites.decode.TUNE_KERNEL_CANDIDATES``; two in a
  dry run), minus the default. Simpler launch: fewer pipeline stages, then fewer warps, then
  fewer pages a step.
- One timed call: the kernel and, where the plan splits, its merge, over rotating sets
  (``bench.suites.decode.kernel_loop``), as the suite's tuning sweep times it.

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/paged_decode.py`` declares its
own (a table measured on an older kernel must not be used: bump it with any change to the
kernel's code that moves its speed).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from bench.harness import RunOptions, TimedLoop, expected_us
from bench.harness.attention_inputs import (
    DRY_RUN_SHAPE,
    STANDARD_SHAPE,
    kv_bytes_per_set,
    make_attention_setup,
)
from bench.suites import decode as decode_suite
from bench.tuning.autotune import Candidate
from kernels_pallas import paged_decode_tuning
from paged.decode import decode_launch_parameters

KERNEL = "paged_decode"
KERNEL_VERSION = 1
DIMENSIONS = ("head_dim", "group_rows", "batch", "context")
BUCKETED = ("batch", "context")
PARAMETERS = decode_suite.LAUNCH_PARAMETERS
# The decode suite's tuned cases; a dry run: one split case at tiny shapes.
BUCKETS = tuple({"batch": b, "context": c} for b, c in decode_suite.TUNE_CASES)
DRY_RUN_BUCKETS = ({"batch": 1, "context": 64},)


@dataclasses.dataclass
class BucketSession:
    """One bucket set up for timing.

    Attributes:
      dims: the bucket key's dimensions (``DIMENSIONS`` order).
      default: today's launch for this bucket.
      candidates: the other launches to try.
      loop_for: ``loop_for(candidate)`` -> the ``TimedLoop`` of one call with its launch.
      expected_us_per_call: a prior for sizing the first timed program.
      description: the shape measured, for the printout.
    """

    dims: dict[str, int]
    default: Candidate
    candidates: list[Candidate]
    loop_for: Callable[[Candidate], TimedLoop]
    expected_us_per_call: float
    description: str


def launch_name(parameters: dict[str, int]) -> str:
    """``{"pages_per_step": 8, "num_warps": 4, "num_stages": 1}`` -> ``"p8_w4_s1"`` (the
    kernel's own naming, ``paged_decode_HND_p8_w4_s1``)."""
    return "p{pages_per_step}_w{num_warps}_s{num_stages}".format(**parameters)


def simplicity(parameters: dict[str, int]) -> tuple[int, int, int]:
    """Sort key of a launch, simplest first: fewer stages, fewer warps, fewer pages a step."""
    return parameters["num_stages"], parameters["num_warps"], parameters["pages_per_step"]


def default_buckets(dry_run: bool) -> list[dict[str, int]]:
    return [dict(bucket) for bucket in (DRY_RUN_BUCKETS if dry_run else BUCKETS)]


@contextlib.contextmanager
def bucket_session(bucket: dict[str, int], options: RunOptions) -> Iterator[BucketSession]:
    """Builds the inputs of one bucket (``batch`` x ``context`` at the standard attention shape,
    or the dry-run shape), yields its ``BucketSession``, frees the inputs after.

    Raises:
      ValueError: if ``bucket`` has other keys than ``batch`` and ``context``.
    """
    if sorted(bucket) != sorted(BUCKETED):
        raise ValueError(f"a {KERNEL} bucket names {list(BUCKETED)}, got {sorted(bucket)}")
    shape = DRY_RUN_SHAPE if options.dry_run else STANDARD_SHAPE
    batch, context = bucket["batch"], bucket["context"]
    num_sets = options.num_sets_for(kv_bytes_per_set(batch, context, **shape))
    setup = make_attention_setup(batch, context, **shape, layouts=("HND",), num_sets=num_sets)
    try:
        plan = decode_suite.plan_for(setup)
        default_parameters = decode_launch_parameters(
            plan, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, setup.page_size
        )
        sweep = (
            decode_suite.DRY_RUN_KERNEL_CANDIDATES
            if options.dry_run
            else decode_suite.TUNE_KERNEL_CANDIDATES
        )
        launches = sorted(
            [default_parameters, *(p for p in sweep if p != default_parameters)], key=simplicity
        )
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)
        group_size = setup.num_q_heads // setup.num_kv_heads
        dims = {
            "head_dim": setup.head_dim,
            "group_rows": paged_decode_tuning.group_rows(group_size),
            "batch": batch,
            "context": context,
        }

        def loop_for(candidate: Candidate) -> TimedLoop:
            return decode_suite.kernel_loop(
                setup, plan, candidate.parameters, include_merge=True, interpret=options.interpret
            )

        yield BucketSession(
            dims=dims,
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=expected_us(setup.kv_bytes_per_set, decode_suite.EXPECTED_TBPS),
            description=f"{setup.case}, up to {int(plan.splits_per_request().max())} split(s)",
        )
    finally:
        setup.delete()
