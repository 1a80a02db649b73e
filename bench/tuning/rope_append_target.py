"""What ``python -m bench tune rope_append`` tunes: the fused RoPE + paged KV append kernel's
launch (``num_warps``; ``kernels_pallas/rope_append.py``), by shape bucket.

- Bucket key: ``num_q_heads``, ``num_kv_heads`` and ``head_dim`` exactly (a program's tile is
  the token's heads x half the head dimension, padded to powers of two), ``tokens`` (new
  tokens a call, one program each) rounded up to a power of two. A bucket is measured at its
  own tokens, the fused_ops suite's attention shape (32 query heads, 8 KV heads, head_dim
  128, pages of 16, bfloat16, Llama 3.1 RoPE).
- Default: ``rope_append``'s keyword default ``num_warps`` (read from its signature), what
  ``paged.rope_append_kv`` runs.
- Candidates: ``num_warps`` 1, 2, 4, 8; two in a dry run. Simpler launch: fewer warps.
- Standard buckets: the fused_ops suite's case, ``rope_append B=64`` (one decode step's new
  tokens).
- One timed call: ``kernels_pallas.rope_append.rope_append`` with the candidate's warps, on the
  arguments ``paged.rope_append_kv`` passes it, in the suite's ``ChainedCallsLoop`` over its
  rotating page tables (``bench.suites.fused_ops.make_rope_inputs``; the pool and q carried
  from call to call, as the suite's ``decodelab`` arm).

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/rope_append.py`` declares its
own; bump it with any change to the kernel that moves its speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator

from bench.harness import RunOptions, expected_us
from bench.suites import fused_ops
from bench.tuning.autotune import Candidate
from bench.tuning.paged_decode_target import BucketSession
from kernels_pallas.rope_append import rope_append
from paged.rope import inverse_frequencies

KERNEL = "rope_append"
KERNEL_VERSION = 1
DIMENSIONS = ("num_q_heads", "num_kv_heads", "head_dim", "tokens")
BUCKETED = ("tokens",)
PARAMETERS = ("num_warps",)
WARPS = (1, 2, 4, 8)
BUCKETS = ({"tokens": fused_ops.ROPE_SHAPE.batch},)
DRY_RUN_BUCKETS = ({"tokens": fused_ops.DRY_RUN_ROPE_SHAPE.batch},)


def default_launch() -> dict[str, int]:
    """The launch ``rope_append`` uses when none is given (its keyword default)."""
    signature = inspect.signature(rope_append)
    return {name: signature.parameters[name].default for name in PARAMETERS}


def launch_name(parameters: dict[str, int]) -> str:
    """``{"num_warps": 4}`` -> ``"w4"``."""
    return "w{num_warps}".format(**parameters)


def simplicity(parameters: dict[str, int]) -> tuple[int]:
    """Sort key of a launch, simplest first: fewer warps."""
    return (parameters["num_warps"],)


def default_buckets(dry_run: bool) -> list[dict[str, int]]:
    return [dict(bucket) for bucket in (DRY_RUN_BUCKETS if dry_run else BUCKETS)]


@contextlib.contextmanager
def bucket_session(bucket: dict[str, int], options: RunOptions) -> Iterator[BucketSession]:
    """Builds the fused_ops suite's RoPE + append inputs for ``tokens`` new tokens (its
    attention shape, or its dry-run shape), yields the ``BucketSession``, frees them after.

    Raises:
      ValueError: if ``bucket`` has other keys than ``tokens``.
    """
    if sorted(bucket) != sorted(BUCKETED):
        raise ValueError(f"a {KERNEL} bucket names {list(BUCKETED)}, got {sorted(bucket)}")
    base = fused_ops.DRY_RUN_ROPE_SHAPE if options.dry_run else fused_ops.ROPE_SHAPE
    shape = dataclasses.replace(base, batch=bucket["tokens"])
    inputs = fused_ops.make_rope_inputs(shape, options)
    inv_freq = inverse_frequencies(shape.head_dim, fused_ops.ROPE)
    try:
        default_parameters = default_launch()
        warps = (default_parameters["num_warps"] // 2,) if options.dry_run else WARPS
        launches = sorted([default_parameters, *({"num_warps": w} for w in warps)], key=simplicity)
        launches = [p for i, p in enumerate(launches) if p not in launches[:i]]
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)

        def loop_for(candidate: Candidate) -> fused_ops.ChainedCallsLoop:
            def call(set_index, set_operands, shared, state):
                del set_index  # the set's arrays are set_operands
                positions, batch_indices, page_indptr, page_indices, last_page_len = set_operands
                k, v = shared
                k_pages, v_pages, q = state
                q_rotated, k_pages, v_pages = rope_append(
                    q,
                    k,
                    v,
                    positions,
                    batch_indices,
                    inv_freq,
                    last_page_len,
                    page_indptr,
                    page_indices,
                    k_pages,
                    v_pages,
                    layout="HND",
                    interleaved=fused_ops.ROPE.interleaved,
                    interpret=options.interpret,
                    **candidate.parameters,
                )
                return k_pages, v_pages, q_rotated

            return fused_ops.ChainedCallsLoop(
                call, inputs.sets, (inputs.k, inputs.v), inputs.state()
            )

        yield BucketSession(
            dims={
                "num_q_heads": shape.num_q_heads,
                "num_kv_heads": shape.num_kv_heads,
                "head_dim": shape.head_dim,
                "tokens": shape.batch,
            },
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=max(
                expected_us(inputs.bytes_per_call, fused_ops.EXPECTED_KERNEL_TBPS),
                fused_ops.EXPECTED_ROPE_US,
            ),
            description=f"{inputs.case} ({shape}), {inputs.num_sets} sets",
        )
    finally:
        inputs.delete()
