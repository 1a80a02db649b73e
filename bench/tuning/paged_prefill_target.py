"""What ``python -m bench tune paged_prefill`` tunes: the causal prefill kernel's launch
(``block_q``, ``pages_per_step``, ``num_warps``, ``num_stages``;
``kernels_pallas/paged_prefill.py``), by shape bucket.

- Bucket key: ``head_dim``, ``group_rows`` (the query-head group padded to a power of two) and
  ``page_size`` exactly, the key of the kernel's own ``LAUNCH_TABLE``; ``chunk`` (new tokens a
  request) and ``context`` (the sequence they end) rounded up to powers of two. Why chunk and
  context: the kernel runs ``chunk / block_q`` query blocks a KV head, each walking the keys it
  sees ``pages_per_step`` pages at a time, so the grid and the walk's length are set by them.
  A bucket is measured at its own size: one request of ``context`` tokens whose last
  ``chunk`` are new (the prefill suite's case, B = 1).
- Default: ``paged_prefill.launch_parameters(head_dim, group_size, page_size)``, the launch
  ``paged.decode_attention`` passes the kernel (what users get; at the standard shape it is
  the kernel's ``DEFAULT_LAUNCH``).
- Candidates: the prefill suite's sweep (``bench.suites.prefill.SWEEP``: ``block_q`` 16, 32,
  64 x pages a step 2, 4, 8 x warps 4, 8 x stages 1, 2, 3; one other launch in a dry run). A
  launch Triton cannot compile (too much shared memory) is recorded as an error in the
  decision and never chosen. Simpler launch: fewer stages, fewer warps, fewer pages a step,
  smaller query blocks.
- Standard buckets: the prefill suite's cases, a 512-token chunk at the end of 16K and 32K
  tokens, Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, pages of 16,
  bfloat16).
- One timed call: the raw ``paged_prefill`` with the candidate's launch over rotating page
  tables of one pool (``bench.suites.prefill.kernel_loop``, the suite's ``--tune`` arm).

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/paged_prefill.py`` declares
its own; bump it with any change to the kernel that moves its speed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax.numpy as jnp

from bench.harness import RunOptions, TimedLoop
from bench.suites import prefill as prefill_suite
from bench.tuning.autotune import Candidate
from bench.tuning.paged_decode_target import BucketSession
from kernels_pallas.paged_prefill import launch_parameters, prefill_flops
from kernels_pallas.tuning_tables import next_power_of_two

KERNEL = "paged_prefill"
KERNEL_VERSION = 1
DIMENSIONS = ("head_dim", "group_rows", "page_size", "chunk", "context")
BUCKETED = ("chunk", "context")
PARAMETERS = ("block_q", "pages_per_step", "num_warps", "num_stages")
BUCKETS = tuple(
    {"chunk": prefill_suite.CHUNK, "context": context} for context in prefill_suite.CONTEXTS
)
DRY_RUN_BUCKETS = ({"chunk": 16, "context": 64},)
DRY_RUN_OTHER = {"block_q": 4, "pages_per_step": 1, "num_warps": 4, "num_stages": 1}


def launch_name(parameters: dict[str, int]) -> str:
    """``{"block_q": 16, "pages_per_step": 4, "num_warps": 4, "num_stages": 2}`` ->
    ``"q16_p4_w4_s2"`` (the suite's ``kernel q16 p4 w4 s2``)."""
    return "q{block_q}_p{pages_per_step}_w{num_warps}_s{num_stages}".format(**parameters)


def simplicity(parameters: dict[str, int]) -> tuple[int, int, int, int]:
    """Sort key of a launch, simplest first: fewer stages, fewer warps, fewer pages a step,
    smaller query blocks."""
    return (
        parameters["num_stages"],
        parameters["num_warps"],
        parameters["pages_per_step"],
        parameters["block_q"],
    )


def default_buckets(dry_run: bool) -> list[dict[str, int]]:
    return [dict(bucket) for bucket in (DRY_RUN_BUCKETS if dry_run else BUCKETS)]


@contextlib.contextmanager
def bucket_session(bucket: dict[str, int], options: RunOptions) -> Iterator[BucketSession]:
    """Builds the prefill suite's inputs for one ``chunk`` x ``context`` case (its standard
    shape, or its dry-run shape in float32), yields the bucket's ``BucketSession``, frees them
    after.

    Raises:
      ValueError: if ``bucket`` has other keys than ``chunk`` and ``context``, or a chunk
        longer than its context.
    """
    if sorted(bucket) != sorted(BUCKETED):
        raise ValueError(f"a {KERNEL} bucket names {list(BUCKETED)}, got {sorted(bucket)}")
    chunk, context = bucket["chunk"], bucket["context"]
    if chunk > context:
        raise ValueError(f"a {KERNEL} bucket's chunk ({chunk}) exceeds its context ({context})")
    shape = prefill_suite.DRY_RUN_SHAPE if options.dry_run else prefill_suite.STANDARD_SHAPE
    dtype = jnp.float32 if options.dry_run else jnp.bfloat16
    group_size = shape["num_q_heads"] // shape["num_kv_heads"]
    inputs = prefill_suite.make_inputs(context, chunk, shape, options, dtype)
    try:
        default_parameters = launch_parameters(shape["head_dim"], group_size, shape["page_size"])
        sweep = [DRY_RUN_OTHER] if options.dry_run else prefill_suite.SWEEP
        launches = sorted(
            [default_parameters, *(p for p in sweep if p != default_parameters)], key=simplicity
        )
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)
        flops = prefill_flops([context], chunk, shape["num_q_heads"], shape["head_dim"])

        def loop_for(candidate: Candidate) -> TimedLoop:
            return prefill_suite.kernel_loop(inputs, candidate.parameters, options.interpret)

        yield BucketSession(
            dims={
                "head_dim": shape["head_dim"],
                "group_rows": next_power_of_two(group_size),
                "page_size": shape["page_size"],
                "chunk": chunk,
                "context": context,
            },
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=max(flops / (prefill_suite.KERNEL_PRIOR_TFLOPS * 1e6), 10.0),
            description=(
                f"{prefill_suite.case_name(context, chunk)}, {inputs.num_sets} rotating sets"
            ),
        )
    finally:
        inputs.delete()
