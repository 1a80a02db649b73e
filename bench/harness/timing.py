"""How one JAX figure is timed: cold L2 by rotating input sets, dispatch amortized in one
jitted loop, median of repeats (``docs/benchmarking.md``, method points 3 to 5).

- ``num_rotating_sets``: how many independent input sets keep the L2 cold (the data touched
  between two visits of one set is at least 4x the L2).
- ``TimedLoop`` / ``time_in_loop``: N calls of the thing under test inside ONE jitted
  ``lax.fori_loop`` over the rotating sets, each result folded into a carried checksum
  (``checksum_of``), the host clock around the whole program, the median of R repeats
  (``Timing``). Dispatch of one program is amortized over N calls, so a 4 us kernel is not
  hidden behind 35 us of Python dispatch. N is a constant of the program (so XLA runs the loop
  without a host round trip per call), sized so that a program lasts about 0.1 s
  (``expected_us``, ``calls_for``).
- ``timing_method_description``: the sentence every report states about this method.

The PyTorch counterpart lives in ``bench/harness/torch_timing.py``, the copy ceiling the figures are
divided by in ``bench/harness/ceiling.py``; both reuse the constants and the program sizing here.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

H200_L2_BYTES = 60 << 20
COLD_L2_FACTOR = 4
MAX_ROTATING_SETS = 4096
DEFAULT_REPEATS = 5
# A timed program of 50 to 200 ms keeps the host-clock and dispatch error under 0.1% while a
# whole suite of a few hundred programs still runs in minutes.
DEFAULT_TARGET_SECONDS = 0.1
MAX_CALLS_PER_PROGRAM = 1 << 20
# ``SetsInTurnLoop`` programs hold one call per set; past this many sets their compilation takes
# minutes. Only sets under ~2 MB need more (batch-1 sampling: 0.5 MB a set), and for those the
# L2 may hold a set between visits: the report says so (``bytes_between_visits``).
MAX_UNROLLED_SETS = 32
# Calls of the thing under test in each iteration of a timed ``fori_loop`` on a GPU. Measured on
# the H200 (``docs/benchmark_results/archive/2026-12-03-loop-overhead-probe.md``): an iteration
# of XLA's while loop costs about 13 to 15 us whatever its body holds, so with one call an
# iteration a loop around nothing but the call's slicing and checksum took 14 to 19 us a call,
# more than a 16 MiB decode kernel; eight calls an iteration bring that to 1.5 to 3.4 us, and
# every arm, ours and the peers', gains the same few microseconds. On a CPU the loop's cost is
# not what is measured and each unrolled call of an interpreted kernel is traced again, so 1.
GPU_LOOP_UNROLL = 8


def default_unroll() -> int:
    """Calls an iteration of a timed loop: ``GPU_LOOP_UNROLL`` on a GPU, else 1."""
    return GPU_LOOP_UNROLL if jax.default_backend() == "gpu" else 1


def timing_method_description(repeats: int = DEFAULT_REPEATS) -> str:
    """The sentence every report states about how its figures were timed."""
    return (
        "dispatch amortized: N calls in one jitted lax.fori_loop over rotating input sets "
        f"(cold L2; N per case in `iters`; {GPU_LOOP_UNROLL} calls an iteration on a GPU, so the "
        "while loop's own cost of about 14 us an iteration is spread over them), each result folded into a carried float32 checksum, "
        f"host clock (time.perf_counter) around the program, median of {repeats} repeats; "
        "PyTorch arms: N calls captured in one CUDA graph, CUDA events around the replays, "
        f"median of {repeats} repeats"
    )


# ----------------------------------------------------------------------------------------------
# Cold L2


def num_rotating_sets(
    bytes_per_set: int,
    l2_bytes: int = H200_L2_BYTES,
    factor: int = COLD_L2_FACTOR,
    max_sets: int = MAX_ROTATING_SETS,
) -> int:
    """How many independent input sets a timed loop rotates over so every call starts cold.

    Between two visits of one set the loop touches the other ``num_sets - 1`` sets, so the rule
    "at least ``factor`` x L2 between visits" needs ``(num_sets - 1) * bytes_per_set >=
    factor * l2_bytes``, that is ``ceil(factor * l2_bytes / bytes_per_set) + 1`` sets, and never
    fewer than 2. The count is capped at ``max_sets`` (default 4096) to bound memory and the
    length of a CUDA graph; the cap binds only for sets under ~60 KB, far below any case of the
    standard grid (a single logits row is 0.5 MB).

    Args:
      bytes_per_set: bytes one call reads from its input set (for attention, the K and V bytes).
      l2_bytes: the L2 size (H200: 60 MB).
      factor: the multiple of the L2 that must lie between two visits.
      max_sets: the cap.

    Returns:
      The number of sets, in ``[2, max_sets]``.

    Raises:
      ValueError: if ``bytes_per_set`` is not positive.

    Example:
      >>> num_rotating_sets(16 << 20)  # 16 MB of KV per call: 15 others make 240 MB
      16
      >>> num_rotating_sets(1 << 30)  # a set larger than 4x the L2: two sets suffice
      2
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    needed = math.ceil(factor * l2_bytes / bytes_per_set) + 1
    return int(min(max(2, needed), max_sets))


# ----------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call times of one measurement, in microseconds.

    Attributes:
      median_us, min_us, max_us: over the repeats.
      samples_us: each repeat's per-call time (program time / calls in it).
      calls_per_sample: the N calls each repeat ran.
      num_sets: the number of rotating input sets.
      method: ``"jax_loop"``, ``"cuda_graph"`` or ``"eager"`` (dry runs of PyTorch arms).
    """

    median_us: float
    min_us: float
    max_us: float
    samples_us: tuple[float, ...]
    calls_per_sample: int
    num_sets: int
    method: str

    @classmethod
    def from_samples(
        cls, samples_us: list[float], calls_per_sample: int, num_sets: int, method: str
    ) -> Timing:
        return cls(
            median_us=statistics.median(samples_us),
            min_us=min(samples_us),
            max_us=max(samples_us),
            samples_us=tuple(samples_us),
            calls_per_sample=calls_per_sample,
            num_sets=num_sets,
            method=method,
        )


def checksum_of(result: Any) -> jax.Array:
    """float32 sum of every element of every array in ``result``.

    Why a full sum and not one element: the compiler may narrow a computation whose only use is
    one element (slice sinking through elementwise ops and dots), which would time less than
    the real work. A full sum forces every output element, and costs one read of the output:
    for a decode step or a sampler that is under 1% of the bytes the call reads (attention:
    B x H x D outputs against B x context x KVH x D x 2 inputs; sampling: B tokens against
    B x V logits).
    """
    leaves = jax.tree_util.tree_leaves(result)
    total = jnp.float32(0)
    for leaf in leaves:
        total = total + jnp.sum(leaf, dtype=jnp.float32)
    return total


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def expected_us(num_bytes: int, tbps: float, floor_us: float = 10.0) -> float:
    """A prior for one call's time: ``num_bytes`` moved at ``tbps`` TB/s, and never less than
    ``floor_us`` (small calls are bound by kernel launches, not bytes), in microseconds.

    ``TimedLoop.time`` sizes its first program with it; pass a rate near what the arm reaches
    (a prior 4x off in either direction costs one more compilation, not accuracy).

    Example:
      >>> expected_us(16_000_000, 0.5), expected_us(1000, 0.5)
      (32.0, 10.0)
    """
    return max(num_bytes / (tbps * 1e12) * 1e6, floor_us)


def calls_for(seconds_per_call: float, target_seconds: float, num_sets: int) -> int:
    """Calls that make a program last about ``target_seconds``: a multiple of ``num_sets`` (every
    set visited equally often), at least ``num_sets``, at most ``MAX_CALLS_PER_PROGRAM``."""
    wanted = max(1, round(target_seconds / max(seconds_per_call, 1e-9)))
    return int(min(max(num_sets, _round_up(wanted, num_sets)), MAX_CALLS_PER_PROGRAM))


def _time_fixed_length_programs(
    runner_for: Callable[[int], Callable[[], float]],
    *,
    num_sets: int,
    iters: int | None,
    expected_us_per_call: float,
    repeats: int,
    warmup: int,
    target_seconds: float,
) -> tuple[list[float], int]:
    """Per-call samples (us) of programs whose number of calls is fixed when they are built.

    ``runner_for(n)`` builds (and caches) the program of n calls and returns a function that
    runs it once and returns the elapsed seconds. Why fixed: XLA knows the trip count of a loop
    with constant bounds and runs its body back to back, while a loop bounded by a runtime value
    copies its predicate to the host and waits after every iteration, which is the "synchronized
    after every call" timing ``docs/benchmarking.md`` warns against.

    With ``iters`` None, the first program is sized from ``expected_us_per_call``; if its warm
    run lasts less than a quarter or more than four times ``target_seconds``, one more program
    is built from its measured per-call time. ``warmup`` untimed runs (at least 2) precede the
    samples.

    Returns:
      ``(samples_us, iters)``.
    """
    adjustable = iters is None
    if iters is None:
        iters = calls_for(expected_us_per_call * 1e-6, target_seconds, num_sets)
    run = runner_for(iters)
    # The first run compiles; the second is already slow-ish on some backends (the jit's fast
    # dispatch path is filled on it), so at least two untimed runs precede the samples.
    run()
    elapsed = run()
    for _ in range(warmup - 2):
        elapsed = run()
    if adjustable and not target_seconds / 4 <= elapsed <= 4 * target_seconds:
        better = calls_for(elapsed / iters, target_seconds, num_sets)
        if better != iters:
            iters = better
            run = runner_for(iters)
            run()
            run()
    samples_us = [run() / iters * 1e6 for _ in range(repeats)]
    return samples_us, iters


class TimedLoop:
    """Jitted programs that each run ``iters`` calls of ``step`` over rotating input sets.

    A program is ``lax.fori_loop(0, iters, body, checksum)`` with a constant ``iters``, where
    ``body`` calls ``step(i % num_sets)`` and adds ``checksum_of`` its result to the carried
    float32 checksum, so no call can be removed as dead code. Programs are cached by ``iters``,
    so an arm timed again (its repeat) reuses its compiled program.

    Large inputs must be passed as ``operands`` (a pytree of arrays): they become arguments of
    the program. Arrays a ``step`` closes over are embedded in the program as constants, which
    for gigabytes of KV pages means a copy and a slow compile.

    Rotate small index arrays (page tables, set indices) over one large pool rather than
    slicing a large stacked input: ``dynamic_slice`` of a large input may copy it before every
    call. The ``step`` must depend on ``set_index``; a call that does not may be hoisted out of
    the loop by the compiler and not be timed at all. With one set the index is hidden from the
    compiler (``program``), since ``i % 1`` is a constant; time cold-L2 figures with at least
    two sets all the same (``num_rotating_sets``), or one set stays in the L2 whenever it fits.

    Args:
      step: ``step(set_index)`` or, with ``operands``, ``step(set_index, operands)``; one call
        of the thing under test on input set ``set_index`` (a traced int32 scalar). Returns a
        pytree of arrays.
      num_sets: the number of rotating input sets.
      operands: the arrays ``step`` reads, or None.
      unroll: calls per iteration of the ``fori_loop`` (its ``unroll``); None for
        ``default_unroll()`` (8 on a GPU, 1 elsewhere). A probe of the loop's own cost
        (``bench/probes/decode_overhead.py``) varies it.
    """

    def __init__(
        self,
        step: Callable[..., Any],
        num_sets: int,
        operands: Any = None,
        unroll: int | None = None,
    ):
        if num_sets < 1:
            raise ValueError(f"num_sets must be >= 1, got {num_sets}")
        if unroll is None:
            unroll = default_unroll()
        if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
            raise ValueError(f"unroll must be an int >= 1, got {unroll!r}")
        self.step = step
        self.num_sets = num_sets
        self.operands = operands
        self.unroll = unroll
        self._programs: dict[int, Callable[[Any], jax.Array]] = {}

    def _call_step(self, set_index, operands):
        if operands is None:
            return self.step(set_index)
        return self.step(set_index, operands)

    def program(self, iters: int) -> Callable[[Any], jax.Array]:
        """The jitted program of ``iters`` calls, taking ``operands`` and returning the
        checksum."""
        if iters not in self._programs:
            num_sets = self.num_sets

            def loop_program(operands):
                def body(call_index, checksum):
                    set_index = lax.rem(call_index, jnp.int32(num_sets))
                    if num_sets == 1:
                        # ``call_index % 1`` folds to the constant 0 (and indexing an axis of
                        # one set ignores the index anyway), so every call is loop-invariant:
                        # XLA may hoist it out of the loop or merge the unrolled copies into
                        # one (bench/probes/mla_decode.py's one-set cases reported up to 8x the
                        # copy ceiling on an H100, the loop unrolling 8). Passed through an
                        # optimization barrier with the carried checksum, the index and the
                        # operands are values XLA cannot see through, so each call stays in the
                        # loop; the barrier forwards the buffers (no copy:
                        # tests/test_bench_timing_loop.py checks the CPU program). Only with one
                        # set: with more, the index varies and every suite's program stays the
                        # one its report measured.
                        set_index, step_operands, _ = lax.optimization_barrier(
                            (set_index, operands, checksum)
                        )
                    else:
                        step_operands = operands
                    return checksum + checksum_of(self._call_step(set_index, step_operands))

                return lax.fori_loop(0, iters, body, jnp.float32(0), unroll=self.unroll)

            self._programs[iters] = jax.jit(loop_program)
        return self._programs[iters]

    def run(self, iters: int) -> float:
        """Runs the program of ``iters`` calls once, waits, returns the elapsed host seconds."""
        program = self.program(iters)
        start = time.perf_counter()
        jax.block_until_ready(program(self.operands))
        return time.perf_counter() - start

    def output(self, set_index: int = 0) -> Any:
        """The result of one call of ``step`` on ``set_index``, to check what an arm computes."""
        return jax.jit(lambda operands: self._call_step(jnp.int32(set_index), operands))(
            self.operands
        )

    def trace(self, iters: int = 1):
        """The traced program of ``iters`` calls (``jax.stages.Traced``), to lower it for
        another platform than this machine's."""
        return self.program(iters).trace(self.operands)

    def lowered_text(self, iters: int = 1) -> str:
        """A program's StableHLO text, to check which kernels it calls (attribution)."""
        return self.trace(iters).lower().as_text()

    def time(
        self,
        *,
        iters: int | None = None,
        repeats: int = DEFAULT_REPEATS,
        warmup: int = 2,
        target_seconds: float = DEFAULT_TARGET_SECONDS,
        expected_us_per_call: float = 100.0,
    ) -> Timing:
        """Compiles, warms up, and times ``repeats`` runs of the program of ``iters`` calls.

        Args:
          iters: calls per timed program; None sizes it so a program lasts about
            ``target_seconds`` (a multiple of ``num_sets``, so every set is visited equally
            often), starting from ``expected_us_per_call``.
          repeats: timed runs; the figure is their median.
          warmup: untimed runs first, at least 2 (the first compiles).
          target_seconds: how long a program should last.
          expected_us_per_call: a prior for one call (``expected_us``); far too low a prior
            makes the first program far too long.

        Returns:
          The per-call ``Timing`` (program time / iters; one dispatch of ~50 us amortized).
        """
        samples_us, iters = _time_fixed_length_programs(
            lambda calls: lambda: self.run(calls),
            num_sets=self.num_sets,
            iters=iters,
            expected_us_per_call=expected_us_per_call,
            repeats=repeats,
            warmup=warmup,
            target_seconds=target_seconds,
        )
        return Timing.from_samples(samples_us, iters, self.num_sets, "jax_loop")


def time_in_loop(
    step: Callable[..., Any],
    num_sets: int,
    *,
    iters: int | None = None,
    operands: Any = None,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = 2,
    target_seconds: float = DEFAULT_TARGET_SECONDS,
    expected_us_per_call: float = 100.0,
) -> Timing:
    """Times one call of ``step`` the ``docs/benchmarking.md`` way; see ``TimedLoop``.

    Timing method: dispatch amortized, N calls in one jitted fori_loop, host clock around the
    program, median of R repeats.

    Args:
      step: ``step(set_index)`` (or ``step(set_index, operands)``) -> pytree of arrays.
      num_sets: rotating input sets (``num_rotating_sets``).
      iters: calls per timed program, or None to size it to ``target_seconds``.
      operands: large arrays ``step`` reads, passed as program arguments.
      repeats, warmup, target_seconds, expected_us_per_call: see ``TimedLoop.time``.

    Returns:
      ``Timing`` with ``min_us <= median_us <= max_us``.

    Example:
      >>> data = jnp.arange(12.0).reshape(3, 4)
      >>> timing = time_in_loop(lambda s, x: x[s] * 2, 3, iters=6, operands=data, repeats=3)
      >>> 0 < timing.min_us <= timing.median_us <= timing.max_us
      True
    """
    loop = TimedLoop(step, num_sets, operands)
    return loop.time(
        iters=iters,
        repeats=repeats,
        warmup=warmup,
        target_seconds=target_seconds,
        expected_us_per_call=expected_us_per_call,
    )


def unrolled_num_sets(bytes_per_set: int) -> int:
    """``num_rotating_sets(bytes_per_set)`` capped at ``MAX_UNROLLED_SETS`` (for
    ``SetsInTurnLoop``, whose program grows with the number of sets)."""
    return min(num_rotating_sets(bytes_per_set), MAX_UNROLLED_SETS)


class SetsInTurnLoop(TimedLoop):
    """A ``TimedLoop`` whose program visits every set in turn, each set its own arrays.

    Why: ``stacked[set_index]`` with a traced index is a ``dynamic_slice``, and XLA copies the
    slice into a buffer of its own before a custom call (a Pallas kernel) can read it: at
    ``256 x 128256`` float32 that copy cost 60 us a call on the H200
    (``bench/probes/slice.py``), timed as if it were the kernel's. Here every set is a separate
    array and the program names each one statically, so nothing is copied; the price is a
    program that holds R calls (compile time grows with R).

    ``call(set_operands, round_index)`` is one call of the arm; round ``r`` of the program's
    ``fori_loop`` runs it on set 0, 1, ..., R - 1, so a program of ``iters`` calls (a multiple
    of R, as ``harness.calls_for`` sizes them) runs ``iters / R`` rounds. Each result is folded
    into the carried checksum, as in ``TimedLoop``.

    A call must depend on ``round_index`` (a key folded with it, or the set passed through
    ``lax.optimization_barrier`` together with it): every set is a fixed array, so a call that
    ignores the round is loop-invariant, and XLA hoists it out of the loop and times nothing.
    """

    def __init__(self, call, operands: list):
        super().__init__(step=None, num_sets=len(operands), operands=operands)
        self.call = call
        # One compilation serves every set (they share shapes): checks visit hundreds of sets.
        self._single_call = jax.jit(call)

    def program(self, iters: int):
        """The program of ``iters`` calls: ``iters / R`` rounds, a constant of the program.

        Why a constant: at 62bfd3a the round count was a program argument (and every call went
        through one jitted function, to lower the arm once); measured on the H200, every JAX arm
        then took about 15 us more a round (5 us a call at batch 256 with 3 sets a round, 0.9 us
        at batch 32 with 17), the PyTorch arms nothing more
        (``docs/benchmark_results/archive/2026-12-01-sampling-62bfd3a.md``). The likely cause: a
        while loop whose trip count XLA cannot see reads its predicate back to the host every
        iteration. The two changes were not told apart; both are undone, so each ``iters``
        compiles its own program, as in ``TimedLoop``.
        """
        if iters not in self._programs:
            num_sets = self.num_sets
            rounds = math.ceil(iters / num_sets)
            if rounds * num_sets != iters:
                raise ValueError(f"iters={iters} is not a multiple of the {num_sets} sets")

            def loop_program(operands):
                def body(round_index, checksum):
                    for set_operands in operands:
                        checksum = checksum + checksum_of(self.call(set_operands, round_index))
                    return checksum

                return lax.fori_loop(0, rounds, body, jnp.float32(0))

            self._programs[iters] = jax.jit(loop_program)
        return self._programs[iters]

    def output(self, set_index: int = 0):
        """One call on set ``set_index`` at round 0 (what the timed calls compute)."""
        return self._single_call(self.operands[set_index], jnp.int32(0))

    def trace(self, iters: int | None = None):
        """The traced program of ``iters`` calls (R by default: one round)."""
        return super().trace(iters or self.num_sets)

    def lowered_text(self, iters: int | None = None) -> str:
        return self.trace(iters).lower().as_text()
