"""Probe: where a small decode call's time goes, and which split and pipeline the Mosaic GPU
kernel wants where the planner splits every request (issue 16).

The decode report of 2026-12-02 fits, over its split cases (all planned to about 264 programs),
a call time of roughly ``14 us + pages a program x 0.5 us``: the 16 MiB cases (B=1 x 4096,
B=4 x 1024) take 18 to 22 us where streaming their bytes takes about 4, and B=1 x 32768 runs
at 53% of the copy ceiling while B=4 x 32768 runs at 89%. This probe separates what a call
costs, per case of ``CASES``:

- ``floor``: the timed loop around nothing but the call's own slicing (the rotating set's
  queries and table) and the checksum of an output shaped like the call's: what the harness
  costs a call, whatever the kernel.
- ``kernel:<pipeline>@<grid>``: the Mosaic GPU kernel alone (partial states, no merge), with
  ``paged.plan_decode(max_grid=<grid>)`` (``GRIDS``: 132, 264 and 528 programs, the
  planner's 264 included) and the ring pipeline ``<pipeline>``, the first of ``PIPELINES``.
- ``split:<pipeline>@<grid>``: the kernel plus ``merge_partial_states`` (what the API runs),
  for each of ``PIPELINES``.
- ``folded:<pipeline>@<grid>``: the merge folded into the decode launch (``merge="folded"``),
  the first pipeline.
- ``api``: ``paged.decode_attention`` as a user calls it (``backend="auto"``, the planner's own
  plan), and ``api.turn``: the same call in ``SetsInTurnLoop`` (every set its own arrays, named
  statically, one call a set each round: no dynamic slice of the table a call);
  ``api.planned`` and ``api.planned.turn``: both again with the planner's host plan, which is
  what the decode suite's ``decodelab`` arm times (no plan built on the device a call).

Every final-output arm is checked against the ``api`` arm's output (largest absolute
difference of ``o``; above ``MAX_DIFFERENCE`` it is a MISMATCH and not timed). Each arm is
timed with the suite's method (``TimedLoop``: rotating sets for a cold L2, dispatch amortized
in one jitted loop, median of 3 repeats).

``--trace`` then runs the ``api`` arm's program once under ``jax.profiler.trace`` and reads
the device's kernel events from its Perfetto trace: the time each kernel is busy a call (by
kernel name), and the device span a call (first kernel start to last kernel end over the
program, divided by the calls). Busy time against span is what launches and the gaps between
kernels cost; span against the ``api`` figure is what the host-clocked loop adds.

- ``jax``: JAX's Pallas ``paged_attention`` (the decode suite's peer) at the ``k_splits`` the
  decode report found fastest for the case (``JAX_K_SPLITS``), to see whether what the loop
  costs our arms costs the peer the same.

What the loop itself costs is a property of how XLA runs it, not of any kernel: ``--unroll N``
puts N calls in each iteration of the ``fori_loop``, and ``bench/run_on_gpu.sh
loop-overhead`` runs the probe again under other ``XLA_FLAGS`` (command buffers, that is CUDA
graphs, for the loop's body or the whole loop); every row records the flags and the unroll.
``--arms floor,api.planned,...`` keeps only the arms whose name starts with one of those.

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.decode_overhead --out DIR [--trace]``
(``--cases 1x4096,4x1024``, ``--grids 264``, ``--pipelines ring.p4.s2`` for a part; no arm
starts after ``--budget-s``). ``--merge separate`` leaves out the folded arms, ``--merge folded`` runs only them: the
folded launch has never run compiled, and a fault would poison the process's CUDA context for
every later arm, so ``bench/run_on_gpu.sh decode-overhead`` runs it in a second process. ``--smoke`` runs a tiny case in Mosaic GPU's interpret mode on a
CPU (the arms and checks, no figures; ``tests/test_bench_probes.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.harness.attention_inputs import make_attention_setup
from bench.harness.device_trace import trace_device_time
from bench.harness.options import RunOptions
from bench.harness.timing import SetsInTurnLoop, TimedLoop
from bench.suites import peers
from bench.suites.decode import _mgpu_kernel, _operands, _table_of_set, kernel_loop
from kernels_pallas.paged_decode_mgpu import smem_bytes_per_program

CASES = ((1, 4096), (4, 1024), (1, 32768), (4, 4096), (4, 16384))
SMOKE_CASE = (1, 64)
GRIDS = (132, 264, 528)
PIPELINES = ("ring.p4.s2", "ring.p4.s4")  # the default, and twice the pages in flight
MAX_DIFFERENCE = 5e-2  # of o against the api arm (bfloat16 outputs of order 1)
TRACE_CALLS = 64
# JAX's Pallas paged_attention: the k_splits the decode report of 2026-12-02 found fastest.
JAX_K_SPLITS = {1: 32, 4: 8}


def jax_peer_loop(setup, interpret: bool) -> TimedLoop:
    """The decode suite's ``jax_pallas_paged_attention`` arm at ``JAX_K_SPLITS``."""
    scaled = (setup.queries * setup.sm_scale).astype(setup.queries.dtype)
    k_splits = JAX_K_SPLITS.get(setup.queries.shape[-3], 1)
    k_splits = max(1, min(k_splits, setup.pages_per_sequence))
    options = RunOptions(dry_run=interpret)
    loop, _ = peers._jax_pallas_loop(setup, scaled, k_splits, options)
    return loop


def parse_pipeline(name: str) -> dict:
    """``"ring.p4.s2"`` -> the kernel's launch keywords."""
    pipeline, pages, stages = name.split(".")
    return dict(pipeline=pipeline, pages_per_step=int(pages[1:]), num_stages=int(stages[1:]))


def floor_loop(setup) -> TimedLoop:
    """The loop, the call's slicing and an output checksum, with no attention at all."""

    def step(set_index, operands):
        queries, page_indices = operands
        # Depends on the set's table as the call does, so nothing is hoisted out of the loop.
        first_page = page_indices[set_index][0].astype(jnp.float32)
        o = queries[set_index] * 2
        lse = jnp.sum(o[..., :1].astype(jnp.float32), axis=-1) + first_page
        return o, lse

    return TimedLoop(step, setup.num_sets, (setup.queries, setup.page_indices))


def api_call(setup, set_index, operands, plan=None):
    """``paged.decode_attention`` on rotating set ``set_index``; ``plan``: a host plan, or None
    for the traced default plan built inside the call."""
    queries, k_pages, v_pages, page_indptr, page_indices, last_page_len = operands
    return paged.decode_attention(
        queries[set_index],
        paged.KVCache(k_pages, v_pages, "HND"),
        _table_of_set(page_indptr, page_indices, last_page_len, set_index, setup.page_size),
        plan=plan,
        return_lse=True,
    )


def api_operands(setup):
    """The decode suite's operands without its plan: the call plans inside ``jit``."""
    return _operands(setup, None)[:-1]


def api_loop(setup) -> TimedLoop:
    return TimedLoop(lambda s, ops: api_call(setup, s, ops), setup.num_sets, api_operands(setup))


def api_turn_loop(setup, plan=None) -> SetsInTurnLoop:
    """The API call with each set's arrays named statically (no dynamic slice a call). The
    pool is shared; the call depends on the round through an optimization barrier. ``plan``:
    a host plan every call uses (the suite's way), else the traced default plan."""
    k_pages, v_pages = setup.pool("HND")
    sets = [
        (
            setup.queries[s],
            setup.page_indptr[s],
            setup.page_indices[s],
            setup.last_page_len[s],
            k_pages,
            v_pages,
        )
        for s in range(setup.num_sets)
    ]

    def call(set_operands, round_index):
        q, indptr, indices, last, k, v = set_operands
        q, round_index = jax.lax.optimization_barrier((q, round_index))
        return paged.decode_attention(
            q,
            paged.KVCache(k, v, "HND"),
            paged.PageTable(indptr, indices, last, setup.page_size),
            plan=plan,
            return_lse=True,
        )

    return SetsInTurnLoop(call, sets)


def planned_api_loop(setup, plan) -> TimedLoop:
    """The decode suite's ``decodelab`` arm: the API with the step's host plan."""

    return TimedLoop(
        lambda s, ops: api_call(setup, s, ops, plan), setup.num_sets, api_operands(setup)
    )


def plan_with_grid(setup, grid: int | None, smoke: bool) -> paged.DecodePlan:
    """``paged.plan_decode``'s plan of set 0 with ``max_grid=grid`` (None: the planner's)."""
    table = _table_of_set(
        setup.page_indptr, setup.page_indices, setup.last_page_len, 0, setup.page_size
    )
    extra = dict(min_chunk_pages=1) if smoke else {}
    plan = paged.plan_decode(
        table, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, max_grid=grid, **extra
    )
    return jax.device_put(plan)


def folded_kernel(q, k_pages, v_pages, page_indices, *work, merge_indptr, **options):
    return _mgpu_kernel(
        q,
        k_pages,
        v_pages,
        page_indices,
        *work,
        merge="folded",
        merge_indptr=merge_indptr,
        **options,
    )


def folded_loop(setup, plan, params, interpret) -> TimedLoop:
    return kernel_loop(
        setup,
        plan,
        dict(params, merge_indptr=plan.merge_indptr),
        include_merge=False,
        interpret=interpret,
        decode=folded_kernel,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", default=None, help="comma-separated BxCTX")
    parser.add_argument("--grids", default=None, help="comma-separated max_grid values")
    parser.add_argument("--pipelines", default=None, help="comma-separated ring.pP.sS")
    parser.add_argument("--trace", action="store_true", help="also read device time (profiler)")
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument(
        "--merge",
        choices=("separate", "folded", "both"),
        default="both",
        help="which merge arms: the folded merge's compiled launch has not yet run on a GPU, "
        "and a fault poisons the process's CUDA context, so run it in a process of its own",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny interpreted case (CPU)")
    parser.add_argument(
        "--unroll", type=int, default=None, help="calls a fori_loop iteration (default: harness)"
    )
    parser.add_argument("--arms", default=None, help="comma-separated arm-name prefixes")
    parser.add_argument("--tag", default="", help="suffix of the JSON file's name")
    args = parser.parse_args(argv)
    if args.unroll is not None and args.unroll < 1:
        parser.error(f"--unroll must be >= 1, got {args.unroll}")
    wanted = tuple(args.arms.split(",")) if args.arms else None
    config = dict(xla_flags=os.environ.get("XLA_FLAGS", ""), unroll=args.unroll)

    smoke = args.smoke
    interpret = smoke or jax.default_backend() != "gpu"
    if smoke:
        cases = [SMOKE_CASE]
        grids = [32]
        pipelines = ["ring.p2.s2"]
    else:
        cases = (
            [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
            if args.cases
            else list(CASES)
        )
        grids = [int(g) for g in args.grids.split(",")] if args.grids else list(GRIDS)
        pipelines = args.pipelines.split(",") if args.pipelines else list(PIPELINES)
    started = time.perf_counter()
    rows: list[dict] = []
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def write():
        if out:
            name = f"decode_overhead_probe{'-' + args.tag if args.tag else ''}.json"
            (out / name).write_text(json.dumps(rows, indent=1))

    for batch, context in cases:
        setup = make_attention_setup(
            batch,
            context,
            num_sets=2 if smoke else None,
            layouts=("HND", peers.PEER_ATTENTION_LAYOUT),
        )
        case = f"B={batch} ctx={context}"
        mbytes = setup.kv_bytes_per_set / 1e6
        reference_o = np.asarray(
            jax.jit(lambda ops, setup=setup: api_call(setup, jnp.int32(0), ops))(
                api_operands(setup)
            )[0],
            np.float32,
        )
        arms: list[tuple[str, object, bool, dict]] = []
        if args.merge != "folded":
            arms.append(("floor", floor_loop(setup), False, {}))
            arms.append(("api", api_loop(setup), True, {}))
            arms.append(("api.turn", api_turn_loop(setup), True, {}))
            # The suite's own arm (a host plan), and the same with every set named statically:
            # what the timed loop's dynamic slices cost the suite's figure.
            host_plan = plan_with_grid(setup, None, smoke)
            arms.append(("api.planned", planned_api_loop(setup, host_plan), True, {}))
            arms.append(("api.planned.turn", api_turn_loop(setup, host_plan), True, {}))
            arms.append(("jax", jax_peer_loop(setup, interpret), False, {}))
        for grid in grids:
            plan = plan_with_grid(setup, grid, smoke)
            info = dict(
                grid=grid,
                items=int(plan.num_work_items),
                chunk_pages=int(plan.chunk_pages),
                write_final=plan.write_final,
            )
            for name in pipelines:
                params = dict(parse_pipeline(name), probs_in_smem=interpret)
                smem = smem_bytes_per_program(
                    setup.head_dim,
                    setup.queries.dtype,
                    **parse_pipeline(name),
                    probs_in_smem=interpret,
                )
                info_p = dict(info, smem_bytes=smem)
                if name == pipelines[0] and args.merge != "folded":
                    arms.append(
                        (
                            f"kernel:{name}@{grid}",
                            kernel_loop(
                                setup,
                                plan,
                                params,
                                include_merge=False,
                                interpret=interpret,
                                decode=_mgpu_kernel,
                            ),
                            False,
                            info_p,
                        )
                    )
                arms.append(
                    None
                    if args.merge == "folded"
                    else (
                        f"split:{name}@{grid}",
                        kernel_loop(
                            setup,
                            plan,
                            params,
                            include_merge=True,
                            interpret=interpret,
                            decode=_mgpu_kernel,
                        ),
                        True,
                        info_p,
                    )
                )
                if name == pipelines[0] and not plan.write_final and args.merge != "separate":
                    arms.append(
                        (
                            f"folded:{name}@{grid}",
                            folded_loop(setup, plan, params, interpret),
                            True,
                            info_p,
                        )
                    )
        arms = [a for a in arms if a and (wanted is None or a[0].startswith(wanted))]
        for _, loop, _, _ in arms:
            if args.unroll is not None and not isinstance(loop, SetsInTurnLoop):
                loop.unroll = args.unroll  # a turn loop already holds one call a set
        for arm, loop, check, info in arms:
            row = dict(case=case, arm=arm, mb=round(mbytes, 2), **info, **config)
            if time.perf_counter() - started > args.budget_s:
                row["skipped"] = "budget"
                rows.append(row)
                continue
            try:
                if check:
                    o = np.asarray(loop.output(0)[0], np.float32).reshape(reference_o.shape)
                    diff = float(np.max(np.abs(o - reference_o)))
                    row["max_abs_difference_from_api"] = diff
                    if not diff <= MAX_DIFFERENCE:
                        row["error"] = f"MISMATCH {diff:.3g}"
                if "error" not in row:
                    if smoke:
                        loop.run(loop.num_sets)
                    else:
                        timing = loop.time(repeats=3, expected_us_per_call=30.0)
                        row["median_us"] = round(timing.median_us, 2)
                        row["min_us"] = round(timing.min_us, 2)
                        row["max_us"] = round(timing.max_us, 2)
                        row["tbps"] = round(mbytes / timing.median_us, 3)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                traceback.print_exc()
            rows.append(row)
            print(
                f"  {case} {arm}: "
                + (row.get("error") or row.get("skipped") or f"{row.get('median_us', '-')} us"),
                flush=True,
            )
            write()
        if args.trace and args.merge != "folded":
            calls = 4 if smoke else TRACE_CALLS
            try:
                traced = trace_device_time(api_loop(setup), calls)
            except Exception as error:
                traced = {"error": f"{type(error).__name__}: {error}"}
            rows.append(dict(case=case, arm="api.trace", mb=round(mbytes, 2), **traced))
            print(f"  {case} api.trace: {json.dumps(traced)[:600]}", flush=True)
            write()
        setup.delete()

    print("\ncase | arm | us | TB/s | items | note")
    for row in rows:
        if row["arm"].endswith(".trace"):
            continue
        print(
            f"{row['case']} | {row['arm']} | {row.get('median_us', '-')} | {row.get('tbps', '-')}"
            f" | {row.get('items', '-')} | {row.get('error') or row.get('skipped') or ''}"
        )
    for row in rows:
        if row["arm"].endswith(".trace"):
            print(
                f"{row['case']} trace: busy {row.get('total_busy_us_per_call')} us, span "
                f"{row.get('span_us_per_call')} us a call; {row.get('busy_us_per_call', row)}"
            )
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
