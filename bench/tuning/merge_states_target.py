"""What ``python -m bench tune merge_states`` tunes: the split-KV merge kernel's launch
(``items_per_step``, ``num_warps``; ``kernels_pallas/merge_states.py``), by shape bucket.

- Bucket key: ``head_dim``, ``partial_rows`` (the query rows of a KV head padded to a power of
  two, as ``paged_decode`` writes its partials) and ``num_kv_heads`` exactly; ``batch`` and
  ``splits`` (partial states a request) rounded up to powers of two. Why these: the kernel
  runs ``batch x num_kv_heads`` programs, each folding ``splits`` items of ``partial_rows x
  head_dim`` floats ``items_per_step`` at a time, so the programs in flight, the loop's trip
  count and the tile a step loads are all set by them. A bucket is measured at its own shape:
  every request has exactly ``splits`` partial states.
- Default: what ``merge_partial_states`` uses when no launch is given (its signature's
  defaults, read from it, so a tuned entry must beat what ships).
- Candidates: ``items_per_step`` 1 to 32 (powers of two, the kernel's rule) x ``num_warps``
  2, 4, 8; two in a dry run. Simpler launch: fewer warps, then fewer items a step.
- Standard buckets: the decode suite's standard grid (``ATTENTION_GRID`` at ``STANDARD_SHAPE``)
  where the planner splits (``paged.plan_decode``, as the suite plans them): the merges the
  committed decode reports time inside the API arm.
- One timed call: ``merge_partial_states`` over rotating sets (``TimedLoop``, cold L2). All
  sets' partials sit in ONE pool and a set is a ``merge_indptr`` pointing at its own range of
  it: the kernel reads the pool in place, where slicing a stacked input would copy it before
  every call (``bench.harness.TimedLoop``).

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/merge_states.py`` declares its
own; bump it with any change to the kernel that moves its speed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.harness import RunOptions, TimedLoop, expected_us
from bench.harness.attention_inputs import ATTENTION_GRID, DRY_RUN_SHAPE, STANDARD_SHAPE
from bench.tuning.autotune import Candidate
from bench.tuning.paged_decode_target import BucketSession
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.tuning_tables import next_power_of_two

KERNEL = "merge_states"
KERNEL_VERSION = 1
DIMENSIONS = ("head_dim", "partial_rows", "num_kv_heads", "batch", "splits")
BUCKETED = ("batch", "splits")
PARAMETERS = ("items_per_step", "num_warps")
SWEEP = [{"items_per_step": s, "num_warps": w} for s in (1, 2, 4, 8, 16, 32) for w in (2, 4, 8)]
DRY_RUN_SWEEP = [{"items_per_step": s, "num_warps": 4} for s in (4, 8)]
DRY_RUN_BUCKETS = ({"batch": 1, "splits": 4},)
# A prior for sizing the first timed program: the merge is latency bound, far from the KV
# stream's bandwidth.
EXPECTED_TBPS = 0.5


def default_launch() -> dict[str, int]:
    """The launch ``merge_partial_states`` uses when none is given (its keyword defaults)."""
    signature = inspect.signature(merge_partial_states)
    return {name: signature.parameters[name].default for name in PARAMETERS}


def launch_name(parameters: dict[str, int]) -> str:
    """``{"items_per_step": 8, "num_warps": 4}`` -> ``"i8_w4"``."""
    return "i{items_per_step}_w{num_warps}".format(**parameters)


def simplicity(parameters: dict[str, int]) -> tuple[int, int]:
    """Sort key of a launch, simplest first: fewer warps, then fewer items a step."""
    return parameters["num_warps"], parameters["items_per_step"]


def standard_buckets() -> list[dict[str, int]]:
    """``batch`` and ``splits`` (rounded up) of every standard decode case the planner splits,
    in grid order, each once."""
    buckets: list[dict[str, int]] = []
    for batch, context in ATTENTION_GRID:
        table = paged.PageTable.from_seq_lens(
            [context] * batch, page_size=STANDARD_SHAPE["page_size"]
        )
        plan = paged.plan_decode(
            table,
            STANDARD_SHAPE["num_q_heads"],
            STANDARD_SHAPE["num_kv_heads"],
            STANDARD_SHAPE["head_dim"],
        )
        if plan.write_final:
            continue
        splits = int(plan.splits_per_request().max())
        bucket = {"batch": next_power_of_two(batch), "splits": next_power_of_two(splits)}
        if bucket not in buckets:
            buckets.append(bucket)
    return buckets


def default_buckets(dry_run: bool) -> list[dict[str, int]]:
    return [dict(bucket) for bucket in DRY_RUN_BUCKETS] if dry_run else standard_buckets()


def partial_bytes(batch: int, splits: int, num_kv_heads: int, partial_rows: int, head_dim: int):
    """Bytes one call reads: every item's float32 ``o`` and ``lse`` rows."""
    return batch * splits * num_kv_heads * partial_rows * (head_dim + 1) * 4


@contextlib.contextmanager
def bucket_session(bucket: dict[str, int], options: RunOptions) -> Iterator[BucketSession]:
    """Builds a pool of random partial states for ``num_sets`` rotating sets of ``batch``
    requests x ``splits`` items (the standard attention shape, or the dry-run shape), yields the
    bucket's ``BucketSession``, frees the pool after.

    Raises:
      ValueError: if ``bucket`` has other keys than ``batch`` and ``splits``.
    """
    if sorted(bucket) != sorted(BUCKETED):
        raise ValueError(f"a {KERNEL} bucket names {list(BUCKETED)}, got {sorted(bucket)}")
    shape = DRY_RUN_SHAPE if options.dry_run else STANDARD_SHAPE
    batch, splits = bucket["batch"], bucket["splits"]
    num_q_heads, num_kv_heads = shape["num_q_heads"], shape["num_kv_heads"]
    head_dim = shape["head_dim"]
    partial_rows = next_power_of_two(num_q_heads // num_kv_heads)
    bytes_per_set = partial_bytes(batch, splits, num_kv_heads, partial_rows, head_dim)
    num_sets = options.num_sets_for(bytes_per_set)
    items_per_set = batch * splits
    key_o, key_lse = jax.random.split(jax.random.key(batch * 1000 + splits))
    pool_items = num_sets * items_per_set
    partial_o = jax.random.normal(
        key_o, (pool_items, num_kv_heads, partial_rows, head_dim), jnp.float32
    )
    # Log-sum-exps of a few units apart, as split chunks of one request have.
    partial_lse = 3.0 * jax.random.normal(
        key_lse, (pool_items, num_kv_heads, partial_rows), jnp.float32
    )
    # Set s: request b's items are s * items_per_set + b * splits .. + splits - 1.
    merge_indptr = jnp.asarray(
        np.arange(num_sets)[:, None] * items_per_set + np.arange(batch + 1)[None, :] * splits,
        jnp.int32,
    )
    try:
        default_parameters = default_launch()
        sweep = DRY_RUN_SWEEP if options.dry_run else SWEEP
        launches = sorted(
            [default_parameters, *(p for p in sweep if p != default_parameters)], key=simplicity
        )
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)
        dims = {
            "head_dim": head_dim,
            "partial_rows": partial_rows,
            "num_kv_heads": num_kv_heads,
            "batch": batch,
            "splits": splits,
        }

        def loop_for(candidate: Candidate) -> TimedLoop:
            def step(set_index, operands):
                partial_o, partial_lse, merge_indptr = operands
                return merge_partial_states(
                    partial_o,
                    partial_lse,
                    merge_indptr[set_index],
                    num_q_heads=num_q_heads,
                    out_dtype=jnp.bfloat16,
                    interpret=options.interpret,
                    **candidate.parameters,
                )

            return TimedLoop(step, num_sets, (partial_o, partial_lse, merge_indptr))

        yield BucketSession(
            dims=dims,
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=expected_us(bytes_per_set, EXPECTED_TBPS),
            description=(
                f"B={batch} x {splits} partial states of {num_kv_heads} KV heads x "
                f"{partial_rows} rows x {head_dim}, {num_sets} rotating sets"
            ),
        )
    finally:
        for array in (partial_o, partial_lse, merge_indptr):
            array.delete()
