"""What ``python -m bench tune spec_accept`` tunes: the chain speculative sampling kernel's
launch (``block``, ``num_warps``, ``num_stages`` of its accept-and-draw kernel;
``kernels_pallas/spec_accept.py``), by shape bucket.

- Bucket key: ``vocab`` exactly; ``batch`` and ``drafts`` (``n``, drafted tokens a request)
  rounded up to powers of two. Why: the first kernel runs a program per (request, chunk of
  the vocab), and each walks up to ``n + 1`` positions' rows ``block`` columns at a time, so
  the programs in flight and the rows a program may read are set by batch and drafts. A
  bucket is measured at its own batch and drafts, vocab 128256 (the speculative suite's; 1000
  in a dry run).
- Default: ``chain_speculative_sample``'s keyword defaults (``DEFAULT_BLOCK``,
  ``DEFAULT_NUM_WARPS``, one stage), read from its signature: what the public API runs.
- Candidates: ``block`` 256 to 4096 x ``num_warps`` 2, 4, 8, kept where a thread holds 2 to 16
  columns of a row (the 2026-12-01 sweep, ``bench/tuning/speculative.py``, chose 4); one
  stage. ``prefetch`` stays at the kernel's default: a table holds positive integers, and that
  sweep settled it. The merge kernel's launch is fixed in the kernel (``MERGE_ROWS``,
  ``MERGE_NUM_WARPS``) and not a parameter. Two in a dry run. Simpler launch: fewer stages,
  fewer warps, smaller blocks.
- Standard buckets: the speculative suite's grid (``BATCHES`` 1, 16, 64 x ``DRAFTS`` 1, 4, 8).
- One timed call: ``chain_speculative_sample`` with the candidate's launch on the suite's
  rotating sets (``bench.suites.speculative.make_sets``, ``SetsInTurnLoop``), the rows' key
  words derived from the set's key folded with the round, as ``bench/tuning/speculative.py``
  times it.

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/spec_accept.py`` declares its
own; bump it with any change to the kernel that moves its speed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import jax

from bench.harness import RunOptions, SetsInTurnLoop, expected_us
from bench.suites import speculative as speculative_suite
from bench.tuning.autotune import Candidate
from bench.tuning.paged_decode_target import BucketSession
from kernels_pallas import rng
from kernels_pallas.spec_accept import chain_speculative_sample
from speculative import api, reference

KERNEL = "spec_accept"
KERNEL_VERSION = 1
DIMENSIONS = ("vocab", "batch", "drafts")
BUCKETED = ("batch", "drafts")
PARAMETERS = ("block", "num_warps", "num_stages")
THREADS_PER_WARP = 32
COLUMNS_PER_THREAD = (2, 16)  # the range a candidate keeps, inclusive
SWEEP = [
    {"block": block, "num_warps": warps, "num_stages": 1}
    for block in (256, 512, 1024, 2048, 4096)
    for warps in (2, 4, 8)
    if COLUMNS_PER_THREAD[0] <= block // (THREADS_PER_WARP * warps) <= COLUMNS_PER_THREAD[1]
]
DRY_RUN_OTHER = {"block": 256, "num_warps": 2, "num_stages": 1}
BUCKETS = tuple(
    {"batch": batch, "drafts": drafts}
    for batch in speculative_suite.BATCHES
    for drafts in speculative_suite.DRAFTS
)
DRY_RUN_BUCKETS = ({"batch": 1, "drafts": 1},)
EXPECTED_TBPS = 1.5  # a prior for sizing the first timed program


def default_launch() -> dict[str, int]:
    """The launch ``chain_speculative_sample`` uses when none is given (its keyword
    defaults)."""
    signature = inspect.signature(chain_speculative_sample)
    return {name: signature.parameters[name].default for name in PARAMETERS}


def launch_name(parameters: dict[str, int]) -> str:
    """``{"block": 512, "num_warps": 4, "num_stages": 1}`` -> ``"b512_w4_s1"``."""
    return "b{block}_w{num_warps}_s{num_stages}".format(**parameters)


def simplicity(parameters: dict[str, int]) -> tuple[int, int, int]:
    """Sort key of a launch, simplest first: fewer stages, fewer warps, smaller blocks."""
    return parameters["num_stages"], parameters["num_warps"], parameters["block"]


def default_buckets(dry_run: bool) -> list[dict[str, int]]:
    return [dict(bucket) for bucket in (DRY_RUN_BUCKETS if dry_run else BUCKETS)]


@contextlib.contextmanager
def bucket_session(bucket: dict[str, int], options: RunOptions) -> Iterator[BucketSession]:
    """Builds the speculative suite's rotating sets for ``batch`` requests of ``drafts``
    drafts, yields the bucket's ``BucketSession``, frees them after.

    Raises:
      ValueError: if ``bucket`` has other keys than ``batch`` and ``drafts``.
    """
    if sorted(bucket) != sorted(BUCKETED):
        raise ValueError(f"a {KERNEL} bucket names {list(BUCKETED)}, got {sorted(bucket)}")
    batch, drafts = bucket["batch"], bucket["drafts"]
    vocab = speculative_suite.DRY_RUN_VOCAB if options.dry_run else speculative_suite.VOCAB
    sets = speculative_suite.make_sets(batch, drafts, vocab, options)
    try:
        default_parameters = default_launch()
        launches = [DRY_RUN_OTHER] if options.dry_run else SWEEP
        launches = sorted(
            [default_parameters, *(p for p in launches if p != default_parameters)],
            key=simplicity,
        )
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)

        def loop_for(candidate: Candidate) -> SetsInTurnLoop:
            def call(set_operands, round_index):
                target, draft, tokens, key = set_operands
                words = rng.row_keys(jax.random.fold_in(key, round_index), batch)
                return chain_speculative_sample(
                    draft,
                    tokens,
                    target,
                    words,
                    chunk_size=reference.DEFAULT_CHUNK_SIZE,
                    stream=api.SPECULATIVE_STREAM,
                    interpret=options.interpret,
                    **candidate.parameters,
                )

            return SetsInTurnLoop(call, sets.operands)

        yield BucketSession(
            dims={"vocab": vocab, "batch": batch, "drafts": drafts},
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=expected_us(sets.expected_bytes, EXPECTED_TBPS),
            description=f"{sets.case} vocab={vocab}, {sets.num_sets} sets",
        )
    finally:
        sets.delete()
