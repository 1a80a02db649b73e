"""What ``python -m bench tune norm`` tunes: the fused residual-add RMSNorm kernel's launch
(``num_warps``; ``kernels_pallas/norm.py``), by shape bucket.

- Bucket key: ``hidden`` and ``tokens`` (rows), both rounded up to powers of two. Why: a
  program normalizes ``block_rows`` whole rows of ``next_power_of_two(hidden)`` columns, both
  derived from the shape (``norm.launch_parameters``), so the tile a program's warps share and
  the number of programs are set by them; hidden enters the launch only through its
  power-of-two tile, hence bucketed (a launch tuned at 8192 serves 5120 too, whose tile is
  8192 columns). ``block_rows`` is derived, not a launch parameter of the kernel's signature,
  so it is not tuned. A bucket is measured at its own size, bfloat16.
- Default: ``norm.launch_parameters(tokens, hidden)``'s warps, what ``fused_add_rmsnorm``
  uses when ``num_warps`` is None (one warp for every 512 elements of the tile, 1 to 16).
- Candidates: ``num_warps`` 1, 2, 4, 8, 16 (the kernel's ``MAX_WARPS``); two in a dry run.
  Simpler launch: fewer warps.
- Standard buckets: the fused_ops suite's norm cases (``NORM_HIDDEN`` 4096, 8192 x
  ``NORM_TOKENS`` 1, 64, 4096).
- One timed call: ``kernels_pallas.norm.fused_add_rmsnorm`` with the candidate's warps, as the
  suite's ``decodelab_kernel`` arm times it (``bench.suites.fused_ops``: its inputs, and its
  ``ChainedCallsLoop``, each set's ``(x, residual)`` carried from call to call).

``KERNEL_VERSION`` stands for the kernel until ``kernels_pallas/norm.py`` declares its own;
bump it with any change to the kernel that moves its speed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bench.harness import RunOptions, expected_us
from bench.suites import fused_ops
from bench.tuning.autotune import Candidate
from bench.tuning.paged_decode_target import BucketSession
from kernels_pallas import norm

KERNEL = "norm"
KERNEL_VERSION = 1
DIMENSIONS = ("hidden", "tokens")
BUCKETED = ("hidden", "tokens")
PARAMETERS = ("num_warps",)
WARPS = (1, 2, 4, 8, norm.MAX_WARPS)
BUCKETS = tuple(
    {"hidden": hidden, "tokens": tokens}
    for hidden in fused_ops.NORM_HIDDEN
    for tokens in fused_ops.NORM_TOKENS
)
DRY_RUN_BUCKETS = ({"hidden": 128, "tokens": 4},)
EXPECTED_TBPS = 2.0  # a prior for sizing the first timed program


def default_launch(tokens: int, hidden: int) -> dict[str, int]:
    """The warps ``fused_add_rmsnorm`` uses when none are given."""
    _, _, num_warps = norm.launch_parameters(tokens, hidden)
    return {"num_warps": num_warps}


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
    """Builds the fused_ops suite's norm inputs for ``tokens`` rows of ``hidden`` (bfloat16),
    yields the bucket's ``BucketSession``, frees them after.

    Raises:
      ValueError: if ``bucket`` has other keys than ``hidden`` and ``tokens``, or a ``hidden``
        above the kernel's ``MAX_HIDDEN``.
    """
    if sorted(bucket) != sorted(BUCKETED):
        raise ValueError(f"a {KERNEL} bucket names {list(BUCKETED)}, got {sorted(bucket)}")
    hidden, tokens = bucket["hidden"], bucket["tokens"]
    if hidden > norm.MAX_HIDDEN:
        raise ValueError(f"a {KERNEL} bucket's hidden must be <= {norm.MAX_HIDDEN}, got {hidden}")
    inputs = fused_ops.make_norm_inputs(tokens, hidden, options)
    try:
        default_parameters = default_launch(tokens, hidden)
        warps = (default_parameters["num_warps"] * 2,) if options.dry_run else WARPS
        launches = sorted([default_parameters, *({"num_warps": w} for w in warps)], key=simplicity)
        launches = [p for i, p in enumerate(launches) if p not in launches[:i]]
        ranked = [Candidate(launch_name(p), dict(p), rank) for rank, p in enumerate(launches)]
        default = next(c for c in ranked if c.parameters == default_parameters)

        def loop_for(candidate: Candidate) -> fused_ops.ChainedCallsLoop:
            def call(set_index, set_operands, weight, state):
                del set_operands  # a set is its carried state
                x, residual = state[set_index]
                outputs = norm.fused_add_rmsnorm(
                    x,
                    residual,
                    weight,
                    fused_ops.EPS,
                    interpret=options.interpret,
                    **candidate.parameters,
                )
                return (*state[:set_index], tuple(outputs), *state[set_index + 1 :])

            return fused_ops.ChainedCallsLoop(
                call, [()] * inputs.num_sets, inputs.weight, inputs.state()
            )

        yield BucketSession(
            dims={"hidden": hidden, "tokens": tokens},
            default=default,
            candidates=[c for c in ranked if c is not default],
            loop_for=loop_for,
            expected_us_per_call=expected_us(inputs.bytes_per_call, EXPECTED_TBPS),
            description=f"{inputs.case} bfloat16, {inputs.num_sets} sets",
        )
    finally:
        inputs.delete()
