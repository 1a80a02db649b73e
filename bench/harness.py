"""How one benchmark figure is measured: cold L2, dispatch amortized, median of repeats.

This module implements the method of ``benchmarking.md`` once, so that every suite measures the
same way:

- ``num_rotating_sets``: how many independent input sets keep the L2 cold (the data touched
  between two visits of one set is at least 4x the L2).
- ``TimedLoop`` / ``time_in_loop``: N calls of the thing under test inside ONE jitted
  ``lax.fori_loop`` over the rotating sets, each result folded into a carried checksum, the host
  clock around the whole program, the median of R repeats. Dispatch of one program is amortized
  over N calls, so a 4 us kernel is not hidden behind 35 us of Python dispatch. N is a constant
  of the program (so XLA runs the loop without a host round trip per call), sized so that a
  program lasts about 0.1 s.
- ``time_torch_calls``: the PyTorch counterpart (N calls captured in one CUDA graph, CUDA events
  around the replays), for peers written in PyTorch.
- ``measure_copy_ceiling``: the bandwidth of a large device-to-device copy, measured in the same
  run; achieved bandwidths are reported as a fraction of it.
- ``CaseResult``: one row of a report, with exactly the JSON fields of ``benchmarking.md``.

Nothing here knows about attention or sampling; suites in ``bench/suites/`` do.
"""

from __future__ import annotations

import dataclasses
import gc
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

REPEAT_SUFFIX = " (repeat)"


def timing_method_description(repeats: int = DEFAULT_REPEATS) -> str:
    """The sentence every report states about how its figures were timed."""
    return (
        "dispatch amortized: N calls in one jitted lax.fori_loop over rotating input sets "
        "(cold L2; N per case in `iters`), each result folded into a carried float32 checksum, "
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
    after every call" timing ``benchmarking.md`` warns against.

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
    the loop by the compiler and not be timed at all.

    Args:
      step: ``step(set_index)`` or, with ``operands``, ``step(set_index, operands)``; one call
        of the thing under test on input set ``set_index`` (a traced int32 scalar). Returns a
        pytree of arrays.
      num_sets: the number of rotating input sets.
      operands: the arrays ``step`` reads, or None.
    """

    def __init__(self, step: Callable[..., Any], num_sets: int, operands: Any = None):
        if num_sets < 1:
            raise ValueError(f"num_sets must be >= 1, got {num_sets}")
        self.step = step
        self.num_sets = num_sets
        self.operands = operands
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
                    return checksum + checksum_of(self._call_step(set_index, operands))

                return lax.fori_loop(0, iters, body, jnp.float32(0))

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

    def lowered_text(self, iters: int = 1) -> str:
        """A program's StableHLO text, to check which kernels it calls (attribution)."""
        return self.program(iters).lower(self.operands).as_text()

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
    """Times one call of ``step`` the ``benchmarking.md`` way; see ``TimedLoop``.

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


# ----------------------------------------------------------------------------------------------
# PyTorch peers (optional: torch is imported only when asked for)


def torch_device_for(dry_run: bool) -> str | None:
    """Where PyTorch arms run: ``"cuda"`` on a GPU run, ``"cpu"`` in a dry run, None without
    torch (or, outside a dry run, without CUDA)."""
    try:
        import torch
    except ImportError:
        return None
    if dry_run:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def release_torch_memory(device: str | None) -> None:
    """Collects dropped PyTorch tensors (and their DLPack holds on JAX buffers) and hands
    PyTorch's cached CUDA memory back, so the next case can allocate."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def torch_from_jax(array: jax.Array):
    """A zero-copy torch view of a JAX array (DLPack); bfloat16 goes through int16 if the
    DLPack exchange refuses it."""
    import torch

    # JAX computes asynchronously; the array must exist before another library reads it.
    jax.block_until_ready(array)
    try:
        return torch.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError):
        if array.dtype != jnp.bfloat16:
            raise
        as_int16 = jax.block_until_ready(lax.bitcast_convert_type(array, jnp.int16))
        return torch.from_dlpack(as_int16).view(torch.bfloat16)


def _torch_checksum_add(checksum, result) -> None:
    """Adds a float32 sum of ``result`` (a tensor or a tuple of tensors) into ``checksum``,
    so PyTorch arms pay the same one reduction a call as the JAX arms."""
    tensors = result if isinstance(result, tuple | list) else (result,)
    for tensor in tensors:
        checksum.add_(tensor.sum(dtype=checksum.dtype))


def time_torch_calls(
    call: Callable[[int], Any],
    num_sets: int,
    *,
    device: str,
    repeats: int = DEFAULT_REPEATS,
    target_seconds: float = DEFAULT_TARGET_SECONDS,
    min_calls_per_replay: int = 32,
    calls_per_replay: int | None = None,
) -> Timing:
    """Times one call of a PyTorch arm, dispatch amortized.

    On CUDA: a warm-up on a side stream, then ``calls_per_replay`` calls (cycling over the
    ``num_sets`` sets) captured in one CUDA graph, each result folded into a checksum tensor;
    the graph is replayed enough times to last about ``target_seconds``, timed with CUDA
    events; per-call time = elapsed / (replays x calls_per_replay); median of ``repeats``.
    On the CPU (dry runs only): the same calls run eagerly, host clock; not a speed figure.

    Args:
      call: ``call(set_index)`` with a Python int; returns a tensor or tuple of tensors. It must
        not synchronize with the host (no ``.item()``, no ``torch.multinomial``), or the graph
        capture fails.
      num_sets: rotating input sets.
      device: ``"cuda"`` or ``"cpu"``.
      repeats, target_seconds: as in ``TimedLoop.time``.
      min_calls_per_replay: at least this many calls in the graph (rounded up to a multiple of
        ``num_sets``), so one replay is long next to its launch.
      calls_per_replay: fixed calls per replay (dry runs), overriding the above.

    Returns:
      ``Timing`` with method ``"cuda_graph"`` or ``"eager"``.
    """
    import torch

    if calls_per_replay is None:
        calls_per_replay = _round_up(max(min_calls_per_replay, num_sets), num_sets)
    checksum = torch.zeros((), dtype=torch.float32, device=device)

    def all_calls():
        for call_index in range(calls_per_replay):
            _torch_checksum_add(checksum, call(call_index % num_sets))

    if device != "cuda":
        all_calls()
        all_calls()

        def run_eager(replays: int) -> float:
            start = time.perf_counter()
            for _ in range(replays):
                all_calls()
            return time.perf_counter() - start

        samples = [run_eager(1) / calls_per_replay * 1e6 for _ in range(repeats)]
        return Timing.from_samples(samples, calls_per_replay, num_sets, "eager")

    # Lazy initializations (cuBLAS handles, workspaces) must happen before capture, on a side
    # stream, as the PyTorch CUDA graph documentation prescribes.
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        all_calls()
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_calls()

    def run_replays(replays: int) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

    run_replays(1)
    one_replay_seconds = max(run_replays(1), 1e-7)
    replays = max(1, math.ceil(target_seconds / one_replay_seconds))
    calls = replays * calls_per_replay
    samples = [run_replays(replays) / calls * 1e6 for _ in range(repeats)]
    return Timing.from_samples(samples, calls, num_sets, "cuda_graph")


# ----------------------------------------------------------------------------------------------
# The copy ceiling


@dataclasses.dataclass(frozen=True)
class CopyCeiling:
    """The measured device-copy bandwidth that achieved bandwidths are divided by.

    Attributes:
      tbps: the ceiling used for fractions: the largest of the methods below, in TB/s
        (bytes read + bytes written per second, 1 TB = 1e12 bytes).
      by_method: TB/s of each method that ran (median of repeats).
      bytes_per_copy: bytes read + bytes written by one copy.
    """

    tbps: float
    by_method: dict[str, float]
    bytes_per_copy: int

    def detail(self) -> dict[str, Any]:
        """The ``ceiling_detail`` object of a report's JSON."""
        return {
            "used": "max of the methods",
            "bytes_per_copy": self.bytes_per_copy,
            **{f"{name}_tbps": value for name, value in self.by_method.items()},
        }


def _jax_copy_in_loop_tbps(
    source: jax.Array, repeats: int, target_seconds: float, iters: int | None
) -> float:
    """A copy of ``source`` inside one jitted fori_loop, as a pure data movement.

    XLA removes a plain ``jnp.copy`` whose result only feeds the next iteration (copy
    elision), so each iteration instead writes ``source`` into a slightly larger carried
    destination with ``dynamic_update_slice`` at an offset only known at run time (0): the
    update is done in place, reading ``source`` once and writing it once, and cannot be folded
    away. One element of the destination feeds the checksum, and the next iteration's update
    depends on the carried destination, so no iteration is dead.
    """
    num_elements = source.shape[0]
    destination = jnp.zeros((num_elements + 128,), source.dtype)
    offset = jnp.int32(0)
    programs = {}

    def runner_for(calls: int) -> Callable[[], float]:
        if calls not in programs:

            def program(source, destination, offset):
                def body(call_index, carry):
                    destination, checksum = carry
                    destination = lax.dynamic_update_slice(destination, source, (offset,))
                    element = lax.dynamic_index_in_dim(
                        destination, lax.rem(call_index, num_elements), keepdims=False
                    )
                    return destination, checksum + element.astype(jnp.float32)

                initial = (destination, jnp.float32(0))
                return lax.fori_loop(0, calls, body, initial)[1]

            programs[calls] = jax.jit(program)

        def run() -> float:
            start = time.perf_counter()
            jax.block_until_ready(programs[calls](source, destination, offset))
            return time.perf_counter() - start

        return run

    samples_us, _ = _time_fixed_length_programs(
        runner_for,
        num_sets=1,
        iters=iters,
        expected_us_per_call=expected_us(2 * source.nbytes, 3.0),
        repeats=repeats,
        warmup=2,
        target_seconds=target_seconds,
    )
    destination.delete()
    return 2 * source.nbytes / (statistics.median(samples_us) * 1e-6) / 1e12


def _calibrated_calls(run_calls: Callable[[int], float], target_seconds: float) -> int:
    """Copies one host-timed burst needs to last about ``target_seconds``; ``run_calls(n)``
    runs n back-to-back copies and returns the elapsed seconds."""
    calls = 1
    elapsed = run_calls(calls)
    # Grow until a burst lasts a tenth of the target, so the per-copy estimate is not
    # dominated by the fixed cost of the final synchronization.
    while elapsed < target_seconds / 10 and calls < MAX_CALLS_PER_PROGRAM:
        calls *= 4
        elapsed = run_calls(calls)
    return calls_for(elapsed / calls, target_seconds, 1)


def _median_seconds_per_call(run_calls: Callable[[int], float], calls: int, repeats: int) -> float:
    return statistics.median(run_calls(calls) / calls for _ in range(repeats))


def _jax_copy_back_to_back_tbps(
    source: jax.Array, repeats: int, target_seconds: float, iters: int | None
) -> float:
    """N jitted ``jnp.copy`` calls dispatched back to back, one synchronization at the end.

    Each call runs for milliseconds on gigabytes, far longer than its ~35 us dispatch, so the
    GPU never waits for the host; this is the form in which XLA emits a plain device copy.
    """
    copy = jax.jit(jnp.copy)

    def run_calls(num_calls: int) -> float:
        start = time.perf_counter()
        result = None
        for _ in range(num_calls):
            result = copy(source)  # the previous result is freed once its copy has run
        jax.block_until_ready(result)
        return time.perf_counter() - start

    run_calls(1)
    calls = iters or _calibrated_calls(run_calls, target_seconds)
    seconds_per_copy = _median_seconds_per_call(run_calls, calls, repeats)
    return 2 * source.nbytes / seconds_per_copy / 1e12


def _torch_copy_tbps(num_bytes: int, repeats: int, target_seconds: float) -> float:
    """PyTorch ``dst.copy_(src)`` on CUDA, back to back, timed with CUDA events."""
    import torch

    buffers = {"source": torch.empty(num_bytes // 4, dtype=torch.float32, device="cuda")}
    buffers["source"].normal_()
    buffers["destination"] = torch.empty_like(buffers["source"])
    num_copied = buffers["source"].numel() * buffers["source"].element_size()

    def run_calls(num_calls: int) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(num_calls):
            buffers["destination"].copy_(buffers["source"])
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    run_calls(2)
    calls = _calibrated_calls(run_calls, target_seconds)
    seconds_per_copy = _median_seconds_per_call(run_calls, calls, repeats)
    buffers.clear()  # 2 x num_bytes back to PyTorch's cache, and from there to the device
    torch.cuda.empty_cache()
    return 2 * num_copied / seconds_per_copy / 1e12


def measure_copy_ceiling(
    num_bytes: int = 4 << 30,
    *,
    repeats: int = DEFAULT_REPEATS,
    target_seconds: float = DEFAULT_TARGET_SECONDS,
    iters: int | None = None,
    use_torch: bool = True,
) -> CopyCeiling:
    """Measures the device-to-device copy bandwidth of this machine, now.

    Three methods, all bytes read + bytes written per second (a copy of ``num_bytes`` counts
    ``2 * num_bytes``) on random float32 data, median of ``repeats``:

    - ``jax_loop``: in-place copy inside one jitted ``fori_loop`` with a carried checksum
      (``_jax_copy_in_loop_tbps``), the same timing method as the benchmarks;
    - ``jax_back_to_back``: jitted ``jnp.copy`` calls back to back, one synchronization;
    - ``torch_copy``: PyTorch ``copy_`` timed with CUDA events, when torch with CUDA is
      importable and ``use_torch``.

    The ceiling used for fractions is the largest: a method that falls short of the hardware
    must not make every kernel look closer to the limit than it is.

    Args:
      num_bytes: size of the copied buffer (default 4 GiB, far beyond any cache).
      repeats, target_seconds: as in ``TimedLoop.time``.
      iters: fixed copies per timed program (dry runs), or None to calibrate.
      use_torch: also measure PyTorch when it is available with CUDA.

    Returns:
      ``CopyCeiling``.

    Example:
      >>> ceiling = measure_copy_ceiling(1 << 16, repeats=2, iters=2, use_torch=False)
      >>> sorted(ceiling.by_method), ceiling.tbps > 0
      (['jax_back_to_back', 'jax_loop'], True)
    """
    num_elements = num_bytes // 4
    source = jax.random.normal(jax.random.key(0), (num_elements,), jnp.float32)
    by_method = {
        "jax_loop": _jax_copy_in_loop_tbps(source, repeats, target_seconds, iters),
        "jax_back_to_back": _jax_copy_back_to_back_tbps(source, repeats, target_seconds, iters),
    }
    bytes_per_copy = 2 * source.nbytes
    source.delete()
    if use_torch and torch_device_for(dry_run=False) == "cuda":
        by_method["torch_copy"] = _torch_copy_tbps(num_bytes, repeats, target_seconds)
    return CopyCeiling(
        tbps=max(by_method.values()), by_method=by_method, bytes_per_copy=bytes_per_copy
    )


# ----------------------------------------------------------------------------------------------
# Run options and result records


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
    """

    quick: bool = False
    dry_run: bool = False
    tune: bool = False
    repeats: int = DEFAULT_REPEATS
    target_seconds: float = DEFAULT_TARGET_SECONDS
    sweep_target_seconds: float = 0.05
    dry_run_calls: int = 4

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


CASE_FIELDS = (
    "case",
    "arm",
    "attribution",
    "median_us",
    "min_us",
    "max_us",
    "bytes",
    "achieved_tbps",
    "fraction_of_ceiling",
)


@dataclasses.dataclass
class CaseResult:
    """One arm of one case: a row of a report, with the JSON fields of ``benchmarking.md``.

    Attributes:
      case: what was measured, batch as ``B=<n>``: ``"B=4 ctx=4096"``, ``"top_p B=32"``.
      arm: which implementation (``"xla_gather"``, ``"decodelab"``, ...); an arm timed a second
        time in the same run is named ``"<arm> (repeat)"``.
      attribution: something only this arm produces (the kernel it ran, its ``k_splits``).
      median_us, min_us, max_us: per-call time over the repeats.
      bytes: bytes the call must move (attention: K and V of the real tokens; sampling: the
        float32 logits).
      achieved_tbps: ``bytes / median time``, in 1e12 bytes per second.
      fraction_of_ceiling: ``achieved_tbps / ceiling``.
      extra: suite-specific fields (``k_splits``, ``splits``, ``rounds``, ``iters``, ...),
        flattened into the case's JSON object.

    Example:
      >>> timing = Timing.from_samples([2.0, 1.0, 3.0], 10, 2, "jax_loop")
      >>> row = CaseResult.from_timing("B=1 ctx=16", "xla_gather", "xla", timing, 4_000_000, 4.0)
      >>> row.median_us, row.achieved_tbps, row.fraction_of_ceiling
      (2.0, 2.0, 0.5)
    """

    case: str
    arm: str
    attribution: str
    median_us: float
    min_us: float
    max_us: float
    bytes: int
    achieved_tbps: float
    fraction_of_ceiling: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_timing(
        cls,
        case: str,
        arm: str,
        attribution: str,
        timing: Timing,
        num_bytes: int,
        ceiling_tbps: float,
        **extra: Any,
    ) -> CaseResult:
        """A row from a ``Timing``; the repeats' samples and the loop's shape go to ``extra``."""
        achieved_tbps = num_bytes / (timing.median_us * 1e-6) / 1e12
        loop_fields = {
            "iters": timing.calls_per_sample,
            "num_sets": timing.num_sets,
            "bytes_between_visits": (timing.num_sets - 1) * num_bytes,
            "timing": timing.method,
            "samples_us": list(timing.samples_us),
        }
        return cls(
            case=case,
            arm=arm,
            attribution=attribution,
            median_us=timing.median_us,
            min_us=timing.min_us,
            max_us=timing.max_us,
            bytes=int(num_bytes),
            achieved_tbps=achieved_tbps,
            fraction_of_ceiling=achieved_tbps / ceiling_tbps,
            extra={**loop_fields, **extra},
        )

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object of this case: the fixed fields, then ``extra``.

        Raises:
          ValueError: if an ``extra`` key would overwrite a fixed field.
        """
        clashes = set(self.extra) & set(CASE_FIELDS)
        if clashes:
            raise ValueError(f"extra fields {sorted(clashes)} clash with the fixed case fields")
        fixed = {name: getattr(self, name) for name in CASE_FIELDS}
        return {**fixed, **self.extra}


def repeat_arm(arm: str) -> str:
    """The name of ``arm`` timed a second time in the same run (its noise level)."""
    return arm + REPEAT_SUFFIX


def original_arm(arm: str) -> str:
    """``"x (repeat)"`` -> ``"x"``; any other name is returned unchanged."""
    return arm.removesuffix(REPEAT_SUFFIX)
