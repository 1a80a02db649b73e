"""What ``python -m bench tune gumbel`` tunes: the Gumbel-max sampling kernel's launch
(``quads``, ``steps``, ``num_warps``, ``num_stages``; ``kernels_pallas/gumbel.py``), by shape
bucket.

- Bucket key: ``vocab`` exactly, ``batch`` rounded up to a power of two. Why: the kernel runs
  ``batch x chunks`` programs, a chunk ``steps`` steps of ``4 * quads`` columns, and
  ``default_launch`` itself picks the chunks from batch and vocab (more chunks a row for small
  batches, to fill the GPU). ``steps`` counts columns of a vocab, so an entry serves its own
  vocab only. A bucket is measured at its own batch, vocab 128256 (the sampling suite's;
  1000 in a dry run).
- Default: ``kernels_pallas.gumbel.default_launch(batch, vocab)``, what ``gumbel_sample`` uses
  when no launch is given.
- Candidates: ``quads`` 128, 256, 512 (steps of 512 to 2048 columns) x chunks a row half, equal
  to and twice the default's (turned into ``steps`` for the vocab, at most one chunk a step)
  x ``num_warps`` 4, 8; one stage (the 2026-12-01 sweep, ``bench/tuning/gumbel.py``, found
  stages changed nothing). Two in a dry run. ``fast_math`` is not a launch parameter: it
  changes the noise's last bits and stays at the kernel's default (on, on a GPU). Simpler
  launch: fewer stages, fewer warps, smaller steps (``quads``), fewer chunks (more steps).
- Standard buckets: the sampling suite's batches (``peers.SAMPLING_BATCHES``: 1, 32, 256).
- One timed call: ``gumbel_sample`` from float32 logits at temperature 1 on per-row key
  words, the sampling suite's ``decodelab_kernel`` arm (``bench.suites.sampling``'s inputs and
  round words) with the candidate's launch, over the suite's rotating sets
  (``SetsInTurnLoop``: each set its own array, cold L2 up to the unrolled-set cap).

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/gumbel.py`` declares its own;
bump it with any change to the kernel that moves its speed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax.numpy as jnp
from jax.experimental import pallas as pl

from bench.harness import RunOptions, SetsInTurnLoop, expected_us
from bench.suites import peers
from bench.suites import sampling as sampling_suite
from bench.tuning.autotune import Candidate
from bench.tuning.paged_decode_target import BucketSession
from kernels_pallas.gumbel import default_launch, gumbel_sample
from sampling import api

KERNEL = "gumbel"
KERNEL_VERSION = 1
DIMENSIONS = ("vocab", "batch")
BUCKETED = ("batch",)
PARAMETERS = ("quads", "steps", "num_warps", "num_stages")
QUADS = (128, 256, 512)
CHUNK_FACTORS = (0.5, 1.0, 2.0)
WARPS = (4, 8)
BUCKETS = tuple({"batch": batch} for batch in peers.SAMPLING_BATCHES)
DRY_RUN_BUCKETS = ({"batch": 1},)
# A dry run's one other launch: the default's tile with more warps (interpreted, warps change
# nothing; a launch of several steps a program costs an interpreted compile of 10 s).
DRY_RUN_OTHER = {"quads": 256, "steps": 1, "num_warps": 8, "num_stages": 1}
EXPECTED_TBPS = 2.0  # a prior for sizing the first timed program


def launch_name(parameters: dict[str, int]) -> str:
    """``{"quads": 256, "steps": 8, "num_warps": 4, "num_stages": 1}`` -> ``"q256x8_w4_s1"``
    (the kernel's own naming, ``gumbel_logits_q256x8``)."""
    return "q{quads}x{steps}_w{num_warps}_s{num_stages}".format(**parameters)


def simplicity(parameters: dict[str, int]) -> tuple[int, int, int, int]:
    """Sort key of a launch, simplest first: fewer stages, fewer warps, smaller steps, then
    more steps a program (fewer programs)."""
    return (
        parameters["num_stages"],
        parameters["num_warps"],
        parameters["quads"],
        -parameters["steps"],
    )


def sweep(batch: int, vocab: int) -> list[dict[str, int]]:
    """The candidate launches of one bucket (the default among them), each once."""
    default = default_launch(batch, vocab)
    default_chunks = pl.cdiv(vocab, 4 * default["quads"] * default["steps"])  # as the kernel
    launches: list[dict[str, int]] = []
    for quads in QUADS:
        steps_per_row = pl.cdiv(vocab, 4 * quads)
        for factor in CHUNK_FACTORS:
            chunks = min(steps_per_row, max(1, round(default_chunks * factor)))
            for warps in WARPS:
                launch = {
                    "quads": quads,
                    "steps": pl.cdiv(steps_per_row, chunks),
                    "num_warps": warps,
                    "num_stages": 1,
                }
                if launch not in launches:
                    launches.append(launch)
    return launches


def default_buckets(dry_run: bool) -> list[dict[str, int]]:
    return [dict(bucket) for bucket in (DRY_RUN_BUCKETS if dry_run else BUCKETS)]


@contextlib.contextmanager
def bucket_session(bucket: dict[str, int], options: RunOptions) -> Iterator[BucketSession]:
    """Builds the sampling suite's rotating logits for ``batch`` rows, yields the bucket's
    ``BucketSession``, frees them after.

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
        default_parameters = default_launch(batch, vocab)
        launches = [DRY_RUN_OTHER] if options.dry_run else sweep(batch, vocab)
        launches = sorted(
            [default_parameters, *(p for p in launches if p != default_parameters)],
            key=simplicity,
        )
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)
        temperature = jnp.full((batch,), sampling_suite.TEMPERATURE, jnp.float32)

        def loop_for(candidate: Candidate) -> SetsInTurnLoop:
            def call(set_operands, round_index):
                logits, row_key_words = set_operands
                return gumbel_sample(
                    logits,
                    sampling_suite.round_words(row_key_words, round_index),
                    temperature,
                    from_logits=True,
                    stream=api.EXPONENTIAL_STREAM,
                    interpret=options.interpret,
                    **candidate.parameters,
                )

            return SetsInTurnLoop(
                call, list(zip(inputs.logits_sets, inputs.row_key_words, strict=True))
            )

        yield BucketSession(
            dims={"vocab": vocab, "batch": batch},
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=expected_us(inputs.bytes_per_call, EXPECTED_TBPS),
            description=f"B={batch} vocab={vocab} float32 logits, {inputs.num_sets} sets",
        )
    finally:
        inputs.delete()
