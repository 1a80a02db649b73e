"""The copy ceiling: the device-to-device copy bandwidth measured in the same run
(``docs/benchmarking.md``, method points 1 and 2).

Achieved bandwidths are reported as a fraction of ``CopyCeiling.tbps``, which
``measure_copy_ceiling`` takes as the largest of several copy methods (a copy in one jitted
loop, timed like the benchmarks by ``bench/harness/timing.py``; jitted copies back to back; PyTorch's
``copy_`` when available), so that a method falling short of the hardware cannot make every
kernel look closer to the limit than it is.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from bench.harness.timing import (
    DEFAULT_REPEATS,
    DEFAULT_TARGET_SECONDS,
    MAX_CALLS_PER_PROGRAM,
    _time_fixed_length_programs,
    calls_for,
    expected_us,
)
from bench.harness.torch_timing import torch_device_for


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
