"""Device time from a profiler trace: what each kernel of a timed program costs on the GPU.

The timed loop (``timing.TimedLoop``) measures a call as the host sees a program of N calls: the
call's own kernels, plus the loop's own small kernels a call (the rotating set's slices, the
checksum), plus the gaps between launches. For a call of a few microseconds those extras are of
the call's own size (measured on the H200 at B=1 x 4096: about 8 us of kernels and 3.5 us of
merge inside a 20 us call). ``trace_device_time`` runs one program under ``jax.profiler.trace``
and reads the device's kernel events from the Perfetto trace it writes, so a report can say how
long each kernel itself ran (``docs/benchmarking.md``: device time read from a profiler trace is
the other accepted method; here it is reported beside the timed figure, never instead of it).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import tempfile

import jax


def device_time_from_trace(trace_dir: str, calls: int) -> dict:
    """Per call: each device kernel's busy time (us) and the device span (us), from the
    Perfetto trace ``jax.profiler.trace(create_perfetto_trace=True)`` wrote under
    ``trace_dir``; ``{"error": ...}`` when it holds no device event.

    Returns:
      ``busy_us_per_call`` (kernel name -> us, largest first), ``events_per_call``,
      ``total_busy_us_per_call``, ``span_us_per_call`` (first kernel start to last kernel end,
      over ``calls``), ``processes`` (the device processes read).
    """
    paths = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not paths:
        return {"error": f"no perfetto_trace.json.gz under {trace_dir}"}
    data = json.load(gzip.open(paths[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    devices = {pid for pid, name in processes.items() if "GPU" in name or "device" in name}
    busy: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    start, end = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        busy[e["name"]] += float(e.get("dur", 0.0))
        counts[e["name"]] += 1
        start = min(start, float(e["ts"]))
        end = max(end, float(e["ts"]) + float(e.get("dur", 0.0)))
    if not busy:
        return {"error": "no device events", "processes": sorted(processes.values())}
    per_call = {name: round(total / calls, 3) for name, total in busy.items()}
    return {
        "calls": calls,
        "busy_us_per_call": dict(sorted(per_call.items(), key=lambda kv: -kv[1])),
        "events_per_call": {name: counts[name] / calls for name in per_call},
        "total_busy_us_per_call": round(sum(busy.values()) / calls, 3),
        "span_us_per_call": round((end - start) / calls, 3),
        "processes": sorted(processes[pid] for pid in devices),
    }


def trace_device_time(loop, calls: int) -> dict:
    """``device_time_from_trace`` of one run of ``loop``'s program of ``calls`` calls (a
    ``TimedLoop``; run once untraced first, so that compilation stays out of the trace)."""
    program = loop.program(calls)
    jax.block_until_ready(program(loop.operands))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(program(loop.operands))
        return device_time_from_trace(trace_dir, calls)


def split_by_kernel(result: dict, own_kernels: tuple[str, ...]) -> dict:
    """``result``'s busy time a call in three parts: the kernels whose name contains one of
    ``own_kernels`` (by name), every other device op together (``"other device ops"``: the
    timed loop's slicing and checksum, and the call's own small XLA ops), and the span.

    Example:
      >>> split_by_kernel(
      ...     {"busy_us_per_call": {"paged_decode_x": 8.0, "merge_partial_states": 3.0,
      ...      "loop_add_fusion": 1.5}, "span_us_per_call": 14.0},
      ...     ("paged_decode", "merge_partial_states"),
      ... )
      {'paged_decode_x': 8.0, 'merge_partial_states': 3.0, 'other device ops': 1.5, 'span': 14.0}
    """
    if "error" in result:
        return {"error": result["error"]}
    own, other = {}, 0.0
    for name, us in result["busy_us_per_call"].items():
        if any(kernel in name for kernel in own_kernels):
            own[name] = us
        else:
            other += us
    return {**own, "other device ops": round(other, 3), "span": result["span_us_per_call"]}
