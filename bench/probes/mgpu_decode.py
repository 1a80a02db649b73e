"""Probe: the Mosaic GPU decode kernel (``kernels_pallas/paged_decode_mgpu.py``) on the H200,
checked against and timed beside the Triton kernel (issue 16).

For each case of ``CASES`` (32 query heads, 8 KV heads, head_dim 128, page 16, bfloat16, the
inputs of ``bench.harness.attention_inputs.make_attention_setup``) and one plan from
``paged.plan_decode`` (the planner's default split, the one the Triton kernel runs), every arm
runs the whole decode: the kernel, plus ``merge_partial_states`` when the plan splits.

- ``triton``: ``kernels_pallas/paged_decode.py`` with the launch parameters
  ``paged.decode`` picks (``decode_launch_parameters``);
- ``mgpu:<p path>.p<pages_per_step>.s<num_stages>``: the Mosaic GPU kernel with the softmax
  weights fed to ``p @ V`` from registers (``reg``, the compiled default) or through shared
  memory (``smem``, the interpretable path), a few pipeline shapes (``VARIANTS``).

First every arm's output is compared with the Triton arm's (largest absolute difference of
``o``, and of the LSE, printed); an arm whose compilation or run fails is reported with its
error and left out, never stopping the probe; an arm further than ``MAX_DIFFERENCE`` from the
Triton output is reported as a MISMATCH and not timed. Then each arm is timed with the suite's
method (``bench.harness.timing.TimedLoop``: rotating input sets over one pool for a cold L2,
dispatch amortized in one jitted loop, median of repeats), a table is printed last, and the
rows go to ``--out/mgpu_decode_probe.json``.

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.mgpu_decode --out DIR`` (``--cases 4x1024,
32x4096`` for a subset, ``--variants reg.p1.s4,smem.p1.s4``, ``--max-grid N`` to plan for a
different grid). ``--smoke`` runs one tiny case in Mosaic GPU's interpret mode on a CPU: the
checks and the code paths, no figures (``tests/test_bench.py`` runs it).

``--memcheck`` instead runs a small ragged workload to put under NVIDIA's memcheck (interpret
mode cannot show a read outside an array; memcheck on the compiled kernel can), with the
platform allocator so that every array is its own allocation::

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        compute-sanitizer --tool memcheck python3 -m bench.probes.mgpu_decode --memcheck

It covers ragged lengths (empty, one token, a page plus one, a last page partly filled, an item
longer than a 4-entry index window), a pool and ``page_indices`` sized exactly to the pages in
use (their last entries are read), the final request's rows at the end of the outputs, padding
items, split and unsplit plans, both p paths, pages_per_step 1 and 2, one and five new tokens,
and a table with page numbers outside the pool; it exits 1 if a valid input's result is off.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import traceback

import jax
import numpy as np

import paged
import paged.decode as decode_module
from bench.harness.attention_inputs import make_attention_setup
from bench.harness.timing import TimedLoop
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.paged_decode import paged_decode, token_major
from kernels_pallas.paged_decode_mgpu import paged_decode_mgpu
from paged.attention_reference import decode_attention_reference

CASES = ((1, 4096), (4, 1024), (4, 32768), (32, 4096), (256, 512))
SMOKE_CASE = (2, 70)  # a partly filled last page; split by the smoke plan
SMOKE_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_dim=64)
# (p path, pages_per_step, num_stages): the register path at a few pipeline shapes, the
# shared-memory path at two (what it costs next to the registers).
VARIANTS = (
    ("reg", 1, 4),
    ("reg", 1, 6),
    ("reg", 2, 3),
    ("reg", 2, 4),
    ("smem", 1, 4),
    ("smem", 2, 3),
)
# The smoke run's arms: the interpretable path twice, and one register variant, whose refusal in
# interpret mode exercises the report of a failed arm.
SMOKE_VARIANTS = (("smem", 1, 4), ("smem", 2, 3), ("reg", 1, 4))
MAX_DIFFERENCE = 5e-2  # of o against the Triton kernel's (bfloat16 outputs of order 1)


def variant_name(probs_path: str, pages_per_step: int, num_stages: int) -> str:
    return f"{probs_path}.p{pages_per_step}.s{num_stages}"


def decode_step(kernel, setup, plan, interpret):
    """``step(set_index, operands) -> (o, lse)``: one whole decode of set ``set_index``
    (the kernel, then the merge when the plan splits)."""

    def step(set_index, operands):
        queries, k_pages, v_pages, page_indices, plan = operands
        o, lse = kernel(
            queries[set_index],
            k_pages,
            v_pages,
            page_indices[set_index],
            plan.work_request,
            plan.work_page_start,
            plan.work_page_end,
            plan.work_last_page_len,
            sm_scale=setup.sm_scale,
            logits_soft_cap=None,
            write_final=plan.write_final,
            interpret=interpret,
        )
        if not plan.write_final:
            o, lse = merge_partial_states(
                o,
                lse,
                plan.merge_indptr,
                num_q_heads=setup.num_q_heads,
                out_dtype=setup.queries.dtype,
                interpret=interpret,
            )
        return o, lse

    return step


def arms_for(setup, plan, variants, interpret):
    """name -> kernel callable (keyword launch parameters bound)."""
    params = decode_module.decode_launch_parameters(
        plan, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, setup.page_size
    )

    def triton(*args, **kwargs):
        return paged_decode(*args, layout="HND", **kwargs, **params)

    arms = {"triton": triton}
    for probs_path, pages_per_step, num_stages in variants:

        def mgpu(*args, probs_path=probs_path, pps=pages_per_step, stages=num_stages, **kwargs):
            return paged_decode_mgpu(
                *args,
                pages_per_step=pps,
                num_stages=stages,
                probs_in_smem=probs_path == "smem",
                **kwargs,
            )

        arms["mgpu:" + variant_name(probs_path, pages_per_step, num_stages)] = mgpu
    return arms, params


def memcheck_workload(interpret: bool, smoke: bool) -> int:
    """The ``--memcheck`` workload (module docstring); returns the exit status. ``smoke``: a
    smaller one (one split per token count, fewer heads) for an interpreted run on a CPU."""
    rng = np.random.default_rng(0)
    lens = [0, 1, 17, 300, 33, 100]
    page_size, num_kv_heads, group, head_dim = 16, 8, 4, 128
    if smoke:
        lens, num_kv_heads, head_dim = [0, 1, 17, 100], 2, 64
    num_pages = sum(-(-n // page_size) for n in lens)
    table = paged.PageTable.from_seq_lens(
        lens, page_size, pages=rng.permutation(num_pages).tolist(), num_indices=num_pages
    )
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k_pages, v_pages = (
        jax.numpy.asarray(rng.standard_normal(shape), jax.numpy.bfloat16) for _ in range(2)
    )
    cache = paged.KVCache(k_pages, v_pages, "HND")
    cpu = jax.devices("cpu")[0]  # the reference on the CPU: only the kernels under test on the GPU
    worst = 0.0
    paths = ("smem",) if interpret else ("reg", "smem")
    for q_len in (1, 5):
        q_shape = (len(lens), *((q_len,) if q_len > 1 else ()), num_kv_heads * group, head_dim)
        q = jax.numpy.asarray(rng.standard_normal(q_shape), jax.numpy.bfloat16)
        expected, _ = decode_attention_reference(
            jax.device_put(q, cpu),
            jax.device_put(cache, cpu),
            jax.device_put(table, cpu),
            sm_scale=head_dim**-0.5,
        )
        expected = np.asarray(expected, np.float32)
        splits = [dict(fixed_split_pages=3), dict(max_grid=1)]
        for split in splits[q_len > 1 :] if smoke else splits:
            plan = paged.plan_decode(table, q_shape[-2], num_kv_heads, head_dim, **split)
            for probs_path in paths:
                for pages_per_step in (1,) if smoke else (1, 2):
                    o, _ = run_decode(q, cache, table, plan, probs_path, pages_per_step, interpret)
                    o = np.asarray(o, np.float32)
                    error = np.linalg.norm(o - expected) / np.linalg.norm(expected)
                    worst = max(worst, float(error))
                    print(
                        f"q_len={q_len} {split} {probs_path}.p{pages_per_step} "
                        f"write_final={plan.write_final} relative error {error:.2e}",
                        flush=True,
                    )
    # Page numbers outside the pool (past its end, negative): wrong but finite, no bad access.
    indices = np.asarray(table.page_indices).copy()
    indices[0], indices[-1] = 10 * num_pages, -3
    bad = paged.PageTable(
        table.page_indptr, jax.numpy.asarray(indices), table.last_page_len, page_size
    )
    plan = paged.plan_decode(bad, num_kv_heads * group, num_kv_heads, head_dim, max_grid=1)
    q = jax.numpy.asarray(
        rng.standard_normal((len(lens), num_kv_heads * group, head_dim)), jax.numpy.bfloat16
    )
    o, _ = run_decode(q, cache, bad, plan, paths[0], 1, interpret)
    finite = bool(np.isfinite(np.asarray(o, np.float32)).all())
    print(f"page numbers outside the pool: finite output {finite}", flush=True)
    print(f"device {jax.devices()[0].device_kind}; worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 and finite else 1


def run_decode(q, cache, table, plan, probs_path, pages_per_step, interpret):
    """The Mosaic GPU kernel and, for a split plan, the merge: ``(o, lse)`` shaped like ``q``."""
    q_len = 1 if q.ndim == 3 else q.shape[1]
    o, lse = paged_decode_mgpu(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        *(
            jax.numpy.asarray(a)
            for a in (
                plan.work_request,
                plan.work_page_start,
                plan.work_page_end,
                plan.work_last_page_len,
            )
        ),
        page_indptr=table.page_indptr if q_len > 1 else None,
        last_page_len=table.last_page_len if q_len > 1 else None,
        sm_scale=q.shape[-1] ** -0.5,
        logits_soft_cap=None,
        write_final=plan.write_final,
        pages_per_step=pages_per_step,
        # Windows of 4 page numbers with one page a step: items of more pages than a window
        # (double-buffered windows); the default 256 with two.
        index_window=4 if pages_per_step == 1 else None,
        probs_in_smem=probs_path == "smem",
        interpret=interpret,
    )
    if plan.write_final:
        return o, lse
    o, lse = merge_partial_states(
        o,
        lse,
        jax.numpy.asarray(plan.merge_indptr),
        num_q_heads=q_len * q.shape[-2],
        out_dtype=q.dtype,
        interpret=interpret,
    )
    num_kv_heads = cache.k_pages.shape[1]
    o = token_major(o.reshape(q.shape[0], -1, q.shape[-1]), q_len, num_kv_heads)
    lse = token_major(lse.reshape(q.shape[0], -1), q_len, num_kv_heads)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for mgpu_decode_probe.json")
    parser.add_argument(
        "--smoke", action="store_true", help="one tiny interpreted case, no figures"
    )
    parser.add_argument("--cases", default=None, help="comma-separated BxCTX (default: CASES)")
    parser.add_argument("--variants", default=None, help="comma-separated, e.g. reg.p1.s4")
    parser.add_argument("--max-grid", type=int, default=None, help="plan_decode's max_grid")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("-v", "--verbose", action="store_true", help="print full tracebacks")
    parser.add_argument(
        "--memcheck", action="store_true", help="the compute-sanitizer workload, no timing"
    )
    args = parser.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    if args.memcheck:
        return memcheck_workload(interpret, args.smoke)
    cases = (SMOKE_CASE,) if args.smoke else CASES
    if args.cases:
        cases = tuple(tuple(int(n) for n in case.split("x")) for case in args.cases.split(","))
    variants = SMOKE_VARIANTS if args.smoke else VARIANTS
    if args.variants:
        wanted = args.variants.split(",")
        variants = tuple(v for v in VARIANTS if variant_name(*v) in wanted)
        variants += tuple(
            (name.split(".")[0], int(name.split(".")[1][1:]), int(name.split(".")[2][1:]))
            for name in wanted
            if name not in {variant_name(*v) for v in VARIANTS}
        )
    rows = []
    arm_names = []
    for batch, context in cases:
        shape = SMOKE_SHAPE if args.smoke else {}
        setup = make_attention_setup(batch, context, num_sets=2 if args.smoke else None, **shape)
        table = paged.PageTable(
            setup.page_indptr[0], setup.page_indices[0], setup.last_page_len[0], setup.page_size
        )
        overrides = dict(fixed_split_pages=2) if args.smoke else {}
        if args.max_grid:
            overrides["max_grid"] = args.max_grid
        plan = paged.plan_decode(
            table, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, **overrides
        )
        arms, triton_params = arms_for(setup, plan, variants, interpret)
        arm_names = list(dict.fromkeys(arm_names + list(arms)))
        plan = jax.device_put(plan)
        k_pages, v_pages = setup.pool("HND")
        operands = (setup.queries, k_pages, v_pages, setup.page_indices, plan)
        common = dict(
            case=setup.case,
            num_work_items=int(plan.num_work_items),
            write_final=bool(plan.write_final),
            kv_bytes=setup.kv_bytes_per_set,
            triton_params=triton_params,
        )
        print(
            f"# {setup.case}: {int(plan.num_work_items)} work items, "
            f"{'final' if plan.write_final else 'split + merge'}, Triton {triton_params}",
            flush=True,
        )
        loops, triton_out = {}, None
        for arm, kernel in arms.items():
            loop = TimedLoop(decode_step(kernel, setup, plan, interpret), setup.num_sets, operands)
            row = dict(common, arm=arm)
            try:
                o, lse = jax.jit(lambda ops, loop=loop: loop._call_step(0, ops))(operands)
                o, lse = np.asarray(o, np.float32), np.asarray(lse, np.float32)
            except Exception as error:  # a variant that does not compile is a result, not a stop
                row.update(status="failed", error=first_line(error))
                print(f"{setup.case:>16} {arm:>22} FAILED {row['error']}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                rows.append(row)
                continue
            if triton_out is None:  # the Triton arm runs first
                triton_out = (o, lse)
            o_diff = float(np.max(np.abs(o - triton_out[0])))
            finite = np.isfinite(lse) & np.isfinite(triton_out[1])
            lse_diff = float(np.max(np.abs(lse - triton_out[1])[finite], initial=0.0))
            same_empty_rows = np.array_equal(np.isfinite(lse), np.isfinite(triton_out[1]))
            ok = bool(np.isfinite(o).all()) and o_diff <= MAX_DIFFERENCE and same_empty_rows
            row.update(
                status="ok" if ok else "mismatch", max_abs_diff_o=o_diff, max_abs_diff_lse=lse_diff
            )
            print(
                f"{setup.case:>16} {arm:>22} max|o - triton| = {o_diff:.3g}  "
                f"max|lse - triton| = {lse_diff:.3g}" + ("" if ok else "  MISMATCH"),
                flush=True,
            )
            rows.append(row)
            if ok:
                loops[arm] = (loop, row)
        for arm, (loop, row) in loops.items():
            try:
                timing = loop.time(
                    iters=2 if args.smoke else None,
                    repeats=1 if args.smoke else args.repeats,
                    target_seconds=0.25,
                    expected_us_per_call=150.0,
                )
            except Exception as error:
                row.update(status="failed", error="timing: " + first_line(error))
                print(f"{setup.case:>16} {arm:>22} timing FAILED {row['error']}", flush=True)
                continue
            if args.smoke:  # interpreted: no figure means anything
                continue
            row.update(
                median_us=timing.median_us,
                min_us=timing.min_us,
                max_us=timing.max_us,
                tbps=setup.kv_bytes_per_set / timing.median_us / 1e6,
            )
            print(
                f"{setup.case:>16} {arm:>22} {timing.median_us:9.2f} us "
                f"[{timing.min_us:.2f}, {timing.max_us:.2f}] {row['tbps']:.3f} TB/s",
                flush=True,
            )
        setup.delete()
    if args.out:
        folder = pathlib.Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        document = dict(
            probe="bench/probes/mgpu_decode.py",
            device=jax.devices()[0].device_kind,
            jax_version=jax.__version__,
            smoke=args.smoke,
            rows=rows,
        )
        (folder / "mgpu_decode_probe.json").write_text(json.dumps(document, indent=1))
    print_table(rows, arm_names, smoke=args.smoke)
    return 0


def print_table(rows, arm_names, *, smoke):
    """Median us per case and arm (``fail``/``mismatch`` where it did not run, ``-`` in a
    smoke run), then the Triton time over each arm's."""
    print(
        "\n# median us per call (whole decode: kernel + merge where split)"
        + (" -- smoke run, no figures" if smoke else "")
    )
    width = max(len(arm) for arm in arm_names) + 2
    print(f"{'case':<18}" + "".join(f"{arm:>{width}}" for arm in arm_names))
    for case in dict.fromkeys(row["case"] for row in rows):
        cells = []
        for arm in arm_names:
            found = [row for row in rows if row["case"] == case and row["arm"] == arm]
            if not found:
                cells.append("")
            elif found[0]["status"] != "ok":
                cells.append(found[0]["status"])
            elif "median_us" in found[0]:
                cells.append(f"{found[0]['median_us']:.1f}")
            else:
                cells.append("-")
        print(f"{case:<18}" + "".join(f"{cell:>{width}}" for cell in cells))


if __name__ == "__main__":
    sys.exit(main())
