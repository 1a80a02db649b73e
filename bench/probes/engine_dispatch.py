"""Probe: where an engine step's host time goes, and what XLA's CUDA graphs change (issue 18).

The serving report of 62bfd3a (``docs/benchmark_results/archive/2026-12-01-serving-62bfd3a.md``) found the
overlapped loop's step bound by the host at batch 4 and 32: planning a step took 0.3 to 0.7 ms
and dispatching its jitted program 0.8 to 1.2 ms, against a device step of 0.9 to 1.4 ms. JAX
returns from a jitted call before the device finishes, but XLA enqueues the program's kernels
on the calling thread before it returns, one launch each, unless it recorded them into a CUDA
graph (XLA's "command buffers", chosen by ``XLA_FLAGS=--xla_gpu_enable_command_buffer=...``).
So the question this probe answers: is the dispatch the enqueueing of kernels (then it shrinks
under command buffers and grows with the layers), or JAX's own Python and argument handling
(then it does not)?

For one scenario (``--batch`` requests of ``--context`` prompt tokens, ``--new-tokens`` each,
Llama-3-8B layer shapes with ``--layers`` layers, bfloat16, random weights: the serving suite's
model), it prints and writes:

- ``engine``: the engine's own step statistics (``serving.step_stats.StepStats``), medians over
  the decode steps of a measured run after a warm-up run, for the overlapped and the
  synchronous loop: plan, dispatch, device wait, fetch, and the wall step;
- ``enqueue``: the jitted decode program called ``--calls`` times back to back on one step's
  inputs without waiting (its caches threaded through, as the engine does), the host time a
  call until it returned, then the device time a call once everything finished: the cost of
  the call alone, with no planning and no fetching;
- ``device``: the same program's device time a call (the run of ``enqueue``, total / calls,
  once the device is the bottleneck).

Run it once per ``XLA_FLAGS`` setting, each in its own process (``bench/run_on_gpu.sh
engine-dispatch`` runs the default, command buffers off, and command buffers for every kind of
command with a minimum graph size of 1); the flags in force are printed in each row.

``--steps-per-program K`` runs the engine with ``max_steps_per_program=K`` (up to ``K`` decode
steps in one jitted program where nothing changes between them: ``serving/engine.py``). A row
is then a program, not a step: ``steps_per_program`` is the median steps a program ran, and
``wall_step_us`` the median of a program's wall time over its steps, the figure to hold
against ``device_us_per_call`` (one single step's device time). ``block_device_us_per_step``
times the ``K``-step program alone the same way, per step (does the scan cost the device
anything?). ``bench/run_on_gpu.sh engine-multistep`` runs ``K`` = 1, 4 and 8.

Usage: ``PYTHONPATH=. python3 -m bench.probes.engine_dispatch --out DIR`` on the GPU;
``--tiny`` takes the tiny trained target's shapes instead (a CPU can run it: the host's share,
not the device's); ``--smoke`` runs it for a few steps (the code paths, no figures;
``tests/test_bench.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

from serving import config as config_lib
from serving import engine as engine_lib
from serving import host_inputs, programs
from serving import model as model_lib
from serving.requests import Request, SamplingParams

PAGE_SIZE = 16
SEED = 7


def build_engine(
    config, params, *, batch: int, max_tokens: int, overlap: bool, chunk: int, steps: int = 1
):
    """An engine with room for ``batch`` requests of ``max_tokens`` tokens each, running up to
    ``steps`` decode steps a program."""
    # Pages for a block of steps are reserved ahead: room for `steps` more tokens a request.
    pages = batch * -(-(max_tokens + steps) // PAGE_SIZE) + 1
    return engine_lib.Engine(
        (config, params),
        num_pages=pages,
        page_size=PAGE_SIZE,
        parallel=batch,
        overlap=overlap,
        max_prefill_tokens=batch * max_tokens,
        prefill_chunk_size=chunk,
        seed=SEED,
        max_steps_per_program=steps,
    )


def requests_for(batch: int, context: int, new_tokens: int, vocab: int, tag: str):
    rng = np.random.default_rng(SEED)
    return [
        Request(
            f"{tag}-{i}",
            rng.integers(0, vocab, size=context + 1).tolist(),
            SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=new_tokens, seed=i),
        )
        for i in range(batch)
    ]


def run_requests(engine, requests) -> list:
    for request in requests:
        engine.submit(request)
    stats = []
    while engine.has_unfinished:
        stats.append(engine.step().stats)
    return stats


def median_us(values) -> float:
    return statistics.median(values) * 1e6 if values else float("nan")


def engine_row(config, params, args, overlap: bool) -> dict:
    """The engine's step statistics over a measured run (after a warm-up run that compiles)."""
    max_tokens = args.context + 1 + args.new_tokens
    engine = build_engine(
        config,
        params,
        batch=args.batch,
        max_tokens=max_tokens,
        overlap=overlap,
        chunk=args.chunk,
        steps=args.steps_per_program,
    )
    vocab = config.vocab_size
    run_requests(engine, requests_for(args.batch, args.context, args.new_tokens, vocab, "warm"))
    stats = run_requests(
        engine, requests_for(args.batch, args.context, args.new_tokens, vocab, "run")
    )
    decode = [s for s in stats if s.num_decode_rows == args.batch and not s.num_prefill_chunks]
    # A program of K steps: its wall time over K is the wall time a decode step.
    wall = [(s.host_s + s.prefill_s + s.decode_s) / s.num_decode_steps for s in decode]
    return {
        "loop": "overlapped" if overlap else "synchronous",
        "steps_per_program_max": args.steps_per_program,
        "steps_per_program": statistics.median([s.num_decode_steps for s in decode])
        if decode
        else float("nan"),
        "decode_steps": sum(s.num_decode_steps for s in decode),
        "steps": len(decode),
        "compiled_steps": sum(s.compiled for s in stats),
        "plan_us": median_us([s.plan_s for s in decode]),
        "dispatch_us": median_us([s.dispatch_s for s in decode]),
        "device_wait_us": median_us([s.device_wait_s for s in decode]),
        "fetch_us": median_us([s.fetch_s for s in decode]),
        "wall_step_us": median_us(wall),
        "engine": engine,
    }


def _time_calls(jitted, engine, packed, packing, static, calls: int) -> tuple[list, float]:
    """Calls ``jitted`` (a decode program) ``calls`` times back to back on one packed input,
    its caches threaded through as the engine does, after 3 warm-up calls; returns the host
    time of each call until it returned, and the total until the device finished."""
    target_caches, draft_caches = engine.target_caches, engine.draft_caches
    engine.target_caches = engine.draft_caches = None  # donated below
    previous = jax.numpy.zeros((engine.parallel, 1), jax.numpy.int32)
    call_s, total_s, outputs = [], 0.0, None
    for phase in ("warm", "timed"):
        jax.block_until_ready(target_caches)
        start = time.perf_counter()
        for _ in range(calls if phase == "timed" else 3):
            before = time.perf_counter()
            *outputs, target_caches, draft_caches = jitted(
                engine.target_params,
                engine.draft_params,
                target_caches,
                draft_caches,
                packed,
                previous,
                packing=packing,
                **static,
            )
            if phase == "timed":
                call_s.append(time.perf_counter() - before)
        jax.block_until_ready((outputs, target_caches))
        total_s = time.perf_counter() - start
    engine.target_caches, engine.draft_caches = target_caches, draft_caches
    return call_s, total_s


def enqueue_row(engine, args) -> dict:
    """The decode program alone, called back to back on the inputs of one step; with ``K >
    1`` also the ``K``-step program on the inputs of one block."""
    captured = []
    decode_inputs = engine._decode_inputs

    def recording(batch):
        inputs = decode_inputs(batch)
        captured.append(inputs)
        return inputs

    engine._decode_inputs = recording
    vocab = engine.target_config.vocab_size
    engine.submit(requests_for(args.batch, args.context, args.new_tokens, vocab, "enq")[0])
    while engine.has_unfinished:  # to the end: no step in flight when the caches are reused
        engine.step()
    del engine._decode_inputs
    single = [inputs for inputs in captured if programs.num_steps(inputs) == 1]
    # A block's first step is a single step's input as well (its table padded a little more).
    inputs = single[-1] if single else programs.first_step(captured[-1])
    static = dict(
        target_config=engine.target_config,
        draft_config=engine.draft_config,
        backend=engine.backend,
    )
    packed, packing = host_inputs.pack(inputs)
    call_s, total_s = _time_calls(
        programs.decode_step_jit,
        engine,
        packed,
        packing,
        static | dict(num_speculative=engine.num_speculative),
        args.calls,
    )
    row = {
        "call_us": median_us(call_s),
        "call_p90_us": float(np.percentile(call_s, 90) * 1e6),
        "device_us_per_call": total_s / args.calls * 1e6,
        "calls": args.calls,
    }
    blocks = _blocks(captured)
    if blocks:
        block = max(blocks, key=programs.num_steps)
        steps = programs.num_steps(block)
        packed, packing = host_inputs.pack(block)
        call_s, total_s = _time_calls(
            programs.decode_steps_jit, engine, packed, packing, static, args.calls
        )
        row.update(
            block_steps=steps,
            block_call_us=median_us(call_s),
            block_device_us_per_step=total_s / args.calls / steps * 1e6,
        )
    return row


def _blocks(captured) -> list:
    return [inputs for inputs in captured if programs.num_steps(inputs) > 1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--steps-per-program",
        type=int,
        default=1,
        help="the engine's max_steps_per_program K: up to K decode steps a program",
    )
    parser.add_argument("--label", default="", help="a name for this run's XLA_FLAGS setting")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="the tiny trained target's shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps, no figures")
    args = parser.parse_args(argv)
    steps = args.steps_per_program
    if not 1 <= steps <= engine_lib.MAX_STEPS_PER_PROGRAM or steps & (steps - 1):
        parser.error(
            f"--steps-per-program must be a power of two in [1, "
            f"{engine_lib.MAX_STEPS_PER_PROGRAM}], got {steps}"
        )
    if args.smoke:
        args.tiny = True
        args.batch, args.context, args.new_tokens, args.chunk, args.calls = 2, 20, 4, 32, 3
    if args.tiny:
        config = config_lib.TINY_TARGET
    else:
        config = config_lib.llama3_8b_like(args.layers, "bfloat16")
    params = model_lib.init_params(config, jax.random.key(SEED))
    flags = os.environ.get("XLA_FLAGS", "")
    rows = []
    for overlap in (True, False):
        row = engine_row(config, params, args, overlap)
        engine = row.pop("engine")
        if overlap:
            row.update(enqueue_row(engine, args))
        rows.append({"label": args.label, "xla_flags": flags, **row})
    print(
        f"# batch {args.batch}, context {args.context}, {config.num_layers} layers; "
        f"XLA_FLAGS={flags!r} ({jax.devices()[0].device_kind})"
    )
    for row in rows:
        extra = ""
        if "call_us" in row:
            extra = (
                f"  program alone: call {row['call_us']:7.1f} us (p90 "
                f"{row['call_p90_us']:.1f}), device {row['device_us_per_call']:7.1f} us"
            )
            if "block_steps" in row:
                extra += (
                    f"; {row['block_steps']}-step program alone: call "
                    f"{row['block_call_us']:7.1f} us, device "
                    f"{row['block_device_us_per_step']:7.1f} us a step"
                )
        print(
            f"{args.label or 'default':>12} {row['loop']:>11}: plan {row['plan_us']:7.1f} "
            f"dispatch {row['dispatch_us']:7.1f} wait {row['device_wait_us']:7.1f} fetch "
            f"{row['fetch_us']:6.1f} wall step {row['wall_step_us']:7.1f} us"
            f" ({row['steps']} programs, {row['decode_steps']} steps, K <= "
            f"{row['steps_per_program_max']}){extra}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"engine_dispatch_{args.label or 'default'}.json"
        (args.out / name).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
