"""How a PyTorch peer's figure is timed, and how its tensors share JAX's buffers.

The PyTorch counterpart of ``bench/harness/timing.py``: ``time_torch_calls`` captures N calls (cycling
over the rotating sets, each result folded into a checksum tensor) in one CUDA graph and times
its replays with CUDA events, median of repeats, so a PyTorch arm is timed with dispatch
amortized like a JAX arm. ``torch_device_for`` says where PyTorch arms run,
``torch_from_jax`` hands a JAX array to PyTorch without a copy (DLPack), and
``release_torch_memory`` gives PyTorch's cached memory back between cases.

PyTorch is optional: it is imported inside the functions, only when asked for.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from bench.harness.timing import DEFAULT_REPEATS, DEFAULT_TARGET_SECONDS, Timing, _round_up


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
