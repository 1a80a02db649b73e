"""What ``python -m bench tune dual_pivot`` tunes: the dual-pivot filtered sampling kernel's
launch (``block``, ``num_warps``, ``num_stages``; ``kernels_pallas/dual_pivot.py``), by shape
bucket.

- Bucket key: ``vocab`` exactly, ``batch`` rounded up to a power of two. Why: the kernel runs
  one program a row, each streaming its row ``block`` columns at a time over several passes,
  so the programs in flight are the batch and the trip count is ``vocab / block``. A bucket is
  measured at its own batch, vocab 128256 (the sampling suite's; 1000 in a dry run).
- Default: ``dual_pivot_sample``'s keyword defaults (``DEFAULT_BLOCK``, ``DEFAULT_NUM_WARPS``,
  one stage), read from its signature: what the sampling API runs.
- Candidates: ``block`` 2048 to 16384 x ``num_warps`` 4 to 32, kept where a thread holds 8 to
  32 columns of a block (the 2026-11-30 sweep: 16 is best, 32 spills registers at 8192
  columns) and the kernel does not clamp the warps (``num_warps <= block / 256``); one stage
  (stages changed nothing in that sweep). ``prefetch`` stays at the kernel's default: a table
  holds positive integers, and the 2026-12-01 sweep settled it. Two in a dry run. Simpler
  launch: fewer stages, fewer warps, smaller blocks.
- Standard buckets: the sampling suite's batches (``peers.SAMPLING_BATCHES``: 1, 32, 256).
- One timed call: the kernel alone on the ``top_p`` case of the sampling suite (its
  ``decodelab_kernel`` arm: precomputed probabilities and per-row key words, top-p 0.9,
  ``DEFAULT_MAX_ROUNDS``), with the candidate's launch, over the suite's rotating sets
  (``SetsInTurnLoop``). Why top-p alone: every filter shares the launch, and timing the four
  filters in one call would read each set four times, the last three from a warm L2. A filter
  with other pass counts (top-k's radix selection) may prefer another launch; the key cannot
  say which filter (``docs/tuning.md``, not done).

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/dual_pivot.py`` declares its
own; bump it with any change to the kernel that moves its speed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

from bench.harness import RunOptions, SetsInTurnLoop, expected_us
from bench.suites import peers
from bench.suites import sampling as sampling_suite
from bench.tuning.autotune import Candidate
from bench.tuning.paged_decode_target import BucketSession
from kernels_pallas.dual_pivot import dual_pivot_sample
from sampling import api
from sampling.reference import DEFAULT_MAX_ROUNDS

KERNEL = "dual_pivot"
KERNEL_VERSION = 1
DIMENSIONS = ("vocab", "batch")
BUCKETED = ("batch",)
PARAMETERS = ("block", "num_warps", "num_stages")
THREADS_PER_WARP = 32
COLUMNS_PER_THREAD = (8, 32)  # the range a candidate keeps, inclusive
SWEEP = [
    {"block": block, "num_warps": warps, "num_stages": 1}
    for block in (2048, 4096, 8192, 16384)
    for warps in (4, 8, 16, 32)
    if COLUMNS_PER_THREAD[0] <= block // (THREADS_PER_WARP * warps) <= COLUMNS_PER_THREAD[1]
    and warps <= block // 256
]
# A dry run's vocab (1000) clamps every block to 1024 columns; a 512-column block differs.
DRY_RUN_OTHER = {"block": 512, "num_warps": 2, "num_stages": 1}
BUCKETS = tuple({"batch": batch} for batch in peers.SAMPLING_BATCHES)
DRY_RUN_BUCKETS = ({"batch": 1},)
METHOD = next(m for m in sampling_suite.FILTERED_METHODS if m.name == "top_p")
EXPECTED_TBPS = 1.0  # a prior for sizing the first timed program: several passes over a row


def default_launch() -> dict[str, int]:
    """The launch ``dual_pivot_sample`` uses when none is given (its keyword defaults)."""
    signature = inspect.signature(dual_pivot_sample)
    return {name: signature.parameters[name].default for name in PARAMETERS}


def launch_name(parameters: dict[str, int]) -> str:
    """``{"block": 8192, "num_warps": 16, "num_stages": 1}`` -> ``"b8192_w16_s1"``."""
    return "b{block}_w{num_warps}_s{num_stages}".format(**parameters)


def simplicity(parameters: dict[str, int]) -> tuple[int, int, int]:
    """Sort key of a launch, simplest first: fewer stages, fewer warps, smaller blocks."""
    return parameters["num_stages"], parameters["num_warps"], parameters["block"]


def default_buckets(dry_run: bool) -> list[dict[str, int]]:
    return [dict(bucket) for bucket in (DRY_RUN_BUCKETS if dry_run else BUCKETS)]


@contextlib.contextmanager
def bucket_session(bucket: dict[str, int], options: RunOptions) -> Iterator[BucketSession]:
    """Builds the sampling suite's rotating probabilities for ``batch`` rows, yields the
    bucket's ``BucketSession``, frees them after.

    Raises:
      ValueError: if ``bucket`` has other keys than ``batch``.
    """
    if sorted(bucket) != sorted(BUCKETED):
        raise ValueError(f"a {KERNEL} bucket names {list(BUCKETED)}, got {sorted(bucket)}")
    batch = bucket["batch"]
    vocab = peers.DRY_RUN_VOCAB if options.dry_run else peers.VOCAB
    inputs = sampling_suite.make_sampling_inputs(
        batch, vocab, options.unrolled_sets_for(batch * vocab * 4)
    )
    try:
        default_parameters = default_launch()
        launches = [DRY_RUN_OTHER] if options.dry_run else SWEEP
        launches = sorted(
            [default_parameters, *(p for p in launches if p != default_parameters)],
            key=simplicity,
        )
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)
        top_k, top_p, min_p, order = METHOD.kernel_parameters(batch, vocab)

        def loop_for(candidate: Candidate) -> SetsInTurnLoop:
            def call(set_operands, round_index):
                probs, row_key_words = set_operands
                tokens, _ = dual_pivot_sample(
                    probs,
                    sampling_suite.round_words(row_key_words, round_index),
                    top_k,
                    top_p,
                    min_p,
                    order=order,
                    max_rounds=DEFAULT_MAX_ROUNDS,
                    stream=api.ROUND_STREAM,
                    interpret=options.interpret,
                    **candidate.parameters,
                )
                return tokens

            return SetsInTurnLoop(
                call, list(zip(inputs.probs_sets, inputs.row_key_words, strict=True))
            )

        yield BucketSession(
            dims={"vocab": vocab, "batch": batch},
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=expected_us(inputs.bytes_per_call, EXPECTED_TBPS),
            description=(
                f"B={batch} vocab={vocab} float32 probabilities, top_p={METHOD.parameters['top_p']}, "
                f"{inputs.num_sets} sets"
            ),
        )
    finally:
        inputs.delete()
