"""Probe: where did the decode kernel's 10% go? (issue 15, part 1)

The decode report of 2026-11-30 measured the kernel at commit da44cf9; review fixes then added
bounds clamps (scalar clips of the work item, a clip of each step's page numbers, a select on
every step's softmax weights) and the public path measured about 10% slower at 0b23d47. This
probe times, in one run on one GPU and with the suite's method (cold L2, dispatch amortized in
one jitted loop, median of repeats), the same plan through several versions of the kernel:

- ``old``: the kernel and merge of da44cf9 (no clamps), the report's baseline;
- ``head``: the kernel and merge of 0b23d47 (every clamp);
- ``fixed``: this tree's kernel (the work item's request and page range clamped by one
  unsigned minimum each, once a program; the page numbers too, each step; no per-element
  select on the weights for one new token; the table's arrays are no operands for one new
  token);
- ``fixed_noclip``: ``fixed`` without the clamp of page numbers, and ``fixed_noscalar``:
  ``fixed`` without the scalar clamps of the work item (diagnostics only: they may read out of
  bounds on a bad table or plan, so they are never shipped); ``fixed_clips``: ``fixed`` with
  the two-sided clips of 0b23d47 for the work item's scalars (page range, last-page length);
  ``fixed_tokensteps``: ``fixed`` with the loop's step count from tokens (never an all-masked
  step; in the session of 2026-12-01 this was ``fixed`` and the page count, now landed, was the
  variant ``fixed_pagesteps``: ``docs/benchmark_results/archive/2026-12-01-clamp-probe.md``);

each twice, interleaved (A B C D A B C D), so a difference smaller than an arm's own spread is
noise. Also the public ``paged.decode_attention`` with the ``head`` and this tree's kernels.
Every arm's output is compared with the first arm's (``old``), and the largest difference
printed; an arm more than 5e-2 away stops the probe.

The earlier versions' sources are read from ``--sources`` (default ``.probe_src/``), filled by
``git show da44cf9:kernels_pallas/paged_decode.py > .probe_src/old_paged_decode.py`` and the
same for ``old_merge_states.py``, ``head_paged_decode.py``, ``head_merge_states.py``.

Usage (GPU): ``python -m bench.probes.decode_clamps --out $OUT``; ``--smoke`` runs one tiny case
in interpret mode on a CPU (no figure).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import tempfile

import jax
import numpy as np

import paged
import paged.decode as decode_module
from bench.harness.attention_inputs import make_attention_setup
from bench.harness.timing import TimedLoop
from bench.suites import decode as decode_suite
from kernels_pallas import merge_states as merge_module
from kernels_pallas import paged_decode as kernel_module

CASES = ((1, 4096), (4, 1024), (4, 32768), (32, 4096), (128, 1024), (256, 512))
PAGE_CLIP_LINE = "return unsigned_min(pages, num_pages - 1)"
SCALAR_CLAMPS = """    is_padding = request.astype(jnp.uint32) >= batch  # -1 (the planner's padding) wraps up
    request = jnp.where(is_padding, 0, request)
    page_start = unsigned_min(work_page_start_ref[work], num_indices)
    page_end = unsigned_min(work_page_end_ref[work], num_indices)
    last_page_len = work_last_page_len_ref[work]
"""
CLIP_CLAMPS = """    is_padding = request.astype(jnp.uint32) >= batch
    request = jnp.where(is_padding, 0, request)
    page_start = jnp.clip(work_page_start_ref[work], 0, num_indices)
    page_end = jnp.clip(work_page_end_ref[work], page_start, num_indices)
    page_end = jnp.where(is_padding, page_start, page_end)
    last_page_len = jnp.clip(work_last_page_len_ref[work], 0, page_size)
"""
NO_SCALAR_CLAMPS = """    is_padding = request < 0
    request = jnp.maximum(request, 0)
    page_start = work_page_start_ref[work]
    page_end = work_page_end_ref[work]
    last_page_len = work_last_page_len_ref[work]
"""


REQUEST_CLAMP = """    is_padding = request.astype(jnp.uint32) >= batch  # -1 (the planner's padding) wraps up
    request = jnp.where(is_padding, 0, request)
"""
START_CLAMP = "    page_start = unsigned_min(work_page_start_ref[work], num_indices)\n"
END_CLAMP = "    page_end = unsigned_min(work_page_end_ref[work], num_indices)\n"
PAGE_MASK = "        page_is_real = first + jnp.arange(pages_per_step) < page_end\n"
INDEX_MASK = """        index = first + jnp.arange(pages_per_step)
        page_is_real = (index < page_end) & (index.astype(jnp.uint32) < num_indices)
"""
FINAL_STORE = "    if write_final:\n        keep = row_is_real & ~is_padding\n"
LATE_REQUEST = """    request = work_request_ref[work]
    request = jnp.where(request.astype(jnp.uint32) >= batch, 0, request)  # for the q load only
"""
LATE_STORE = """    if write_final:
        request = work_request_ref[work]  # again: nothing about it lives across the loop
        is_padding = request.astype(jnp.uint32) >= batch
        first_row = (jnp.where(is_padding, 0, request) * num_kv_heads + kv_head) * query_rows
        keep = row_is_real & ~is_padding
"""
STEPS = "    num_steps = pl.cdiv(page_end - page_start, pages_per_step)\n"
# Diagnostics that take the work item's scalar clamps apart, one at a time (session of
# 2026-12-01, second probe): which one costs, and whether a masked page-index load (the range
# checked against page_indices per step instead of clamped once) keeps safety without it.
SCALAR_DIAGNOSTICS = {
    "noreq": [
        (REQUEST_CLAMP, "    is_padding = request < 0\n    request = jnp.maximum(request, 0)\n")
    ],
    "nostart": [(START_CLAMP, "    page_start = work_page_start_ref[work]\n")],
    "noend": [(END_CLAMP, "    page_end = work_page_end_ref[work]\n")],
    "late": [(REQUEST_CLAMP, LATE_REQUEST), (FINAL_STORE, LATE_STORE)],
    "late_nostart": [
        (REQUEST_CLAMP, LATE_REQUEST),
        (FINAL_STORE, LATE_STORE),
        (START_CLAMP, "    page_start = work_page_start_ref[work]\n"),
    ],
    "maskload": [
        (START_CLAMP, "    page_start = work_page_start_ref[work]\n"),
        (END_CLAMP, "    page_end = work_page_end_ref[work]\n"),
        (PAGE_MASK, INDEX_MASK),
    ],
    "maskload_bounded": [
        (START_CLAMP, "    page_start = work_page_start_ref[work]\n"),
        (END_CLAMP, "    page_end = work_page_end_ref[work]\n"),
        (PAGE_MASK, INDEX_MASK),
        (
            STEPS,
            STEPS
            + "    num_steps = jnp.minimum(num_steps, pl.cdiv(num_indices, pages_per_step))\n",
        ),
    ],
}


def load_module(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def kernel_variants(sources: pathlib.Path) -> dict[str, tuple]:
    """name -> (decode module, merge module, whether its kernel takes the table's arrays)."""
    fixed_source = pathlib.Path(kernel_module.__file__).read_text()
    assert PAGE_CLIP_LINE in fixed_source, "the page clip moved: update the probe"
    assert SCALAR_CLAMPS in fixed_source, "the scalar clamps moved: update the probe"
    folder = pathlib.Path(tempfile.mkdtemp())
    noclip = folder / "noclip_paged_decode.py"
    noclip.write_text(fixed_source.replace(PAGE_CLIP_LINE, "return pages"))
    noscalar = folder / "noscalar_paged_decode.py"
    noscalar.write_text(fixed_source.replace(SCALAR_CLAMPS, NO_SCALAR_CLAMPS))
    page_steps = "num_steps = pl.cdiv(page_end - page_start, pages_per_step)"
    assert page_steps in fixed_source, "the step count moved: update the probe"
    token_steps = folder / "tokensteps_paged_decode.py"
    token_steps.write_text(
        fixed_source.replace(page_steps, "num_steps = pl.cdiv(num_tokens, block_tokens)")
    )
    clips = folder / "clips_paged_decode.py"
    clips.write_text(fixed_source.replace(SCALAR_CLAMPS, CLIP_CLAMPS))
    variants = {}
    for name, substitutions in SCALAR_DIAGNOSTICS.items():
        source = fixed_source
        for before, after in substitutions:
            assert before in source, f"{name}: the kernel changed, update the probe"
            source = source.replace(before, after)
        path = folder / f"{name}_paged_decode.py"
        path.write_text(source)
        variants[f"fixed_{name}"] = (
            load_module(path, f"probe_{name}_paged_decode"),
            merge_module,
            True,
        )
    named = {
        "old": (
            load_module(sources / "old_paged_decode.py", "probe_old_paged_decode"),
            load_module(sources / "old_merge_states.py", "probe_old_merge_states"),
            False,
        ),
        "head": (
            load_module(sources / "head_paged_decode.py", "probe_head_paged_decode"),
            load_module(sources / "head_merge_states.py", "probe_head_merge_states"),
            True,
        ),
        "fixed": (kernel_module, merge_module, True),
        "fixed_noclip": (load_module(noclip, "probe_noclip_paged_decode"), merge_module, True),
        "fixed_clips": (load_module(clips, "probe_clips_paged_decode"), merge_module, True),
        "fixed_tokensteps": (
            load_module(token_steps, "probe_tokensteps_paged_decode"),
            merge_module,
            True,
        ),
        "fixed_noscalar": (
            load_module(noscalar, "probe_noscalar_paged_decode"),
            merge_module,
            True,
        ),
    }
    return named | variants


def api_step(setup, decode_mod):
    def step(set_index, operands):
        queries, k_pages, v_pages, page_indptr, page_indices, last_page_len, plan = operands
        table = paged.PageTable(
            page_indptr[set_index],
            page_indices[set_index],
            last_page_len[set_index],
            setup.page_size,
        )
        saved = decode_module.paged_decode
        decode_module.paged_decode = decode_mod.paged_decode  # at trace time only
        try:
            return paged.decode_attention(
                queries[set_index],
                paged.KVCache(k_pages, v_pages, "HND"),
                table,
                plan=plan,
                backend="pallas",
                return_lse=True,
            )
        finally:
            decode_module.paged_decode = saved

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", default=".probe_src")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--arms", default=None, help="comma-separated arm names (default: all)")
    parser.add_argument(
        "--cases", default=None, help="comma-separated BxCTX, e.g. 4x32768,32x4096 (default: all)"
    )
    parser.add_argument(
        "--max-grid",
        type=int,
        default=None,
        help="the planner's max_grid (1: no request split, the suite's decodelab_no_split arm)",
    )
    args = parser.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    variants = kernel_variants(pathlib.Path(args.sources))
    cases = ((2, 40),) if args.smoke else CASES
    if args.cases:
        cases = tuple(tuple(int(n) for n in c.split("x")) for c in args.cases.split(","))
    rows = []
    for batch, context in cases:
        shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=16) if args.smoke else {}
        setup = make_attention_setup(batch, context, num_sets=2 if args.smoke else None, **shape)
        table0 = paged.PageTable(
            setup.page_indptr[0], setup.page_indices[0], setup.last_page_len[0], setup.page_size
        )
        overrides = dict(min_chunk_pages=1) if args.smoke else {}
        if args.max_grid is not None:
            overrides["max_grid"] = args.max_grid
        plan = paged.plan_decode(
            table0, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, **overrides
        )
        params = decode_module.decode_launch_parameters(
            plan, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, setup.page_size
        )
        plan = jax.device_put(plan)
        k_pages, v_pages = setup.pool("HND")
        operands = (
            setup.queries,
            k_pages,
            v_pages,
            setup.page_indptr,
            setup.page_indices,
            setup.last_page_len,
            plan,
        )
        loops = {
            f"kernel:{name}": decode_suite.kernel_loop(
                setup,
                plan,
                params,
                include_merge=True,
                interpret=interpret,
                decode=d.paged_decode,
                merge=m.merge_partial_states,
                takes_table=t,
            )
            for name, (d, m, t) in variants.items()
        }
        loops["api:head"] = TimedLoop(
            api_step(setup, variants["head"][0]), setup.num_sets, operands
        )
        loops["api:fixed"] = TimedLoop(api_step(setup, kernel_module), setup.num_sets, operands)
        if args.arms:
            loops = {arm: loop for arm, loop in loops.items() if arm in args.arms.split(",")}
        reference = None
        for arm, loop in loops.items():
            out = jax.jit(lambda ops, loop=loop: loop._call_step(0, ops))(operands)
            o = np.asarray(out[0], np.float32)
            if reference is None:
                reference = o
            diff = float(np.max(np.abs(o - reference)))
            print(f"{setup.case:>16} {arm:>20} max|o - first arm| = {diff:.3g}", flush=True)
            assert np.isfinite(o).all() and diff < 5e-2, (arm, diff)
        iters = {}
        for round_index in range(args.rounds):
            for arm, loop in loops.items():
                timing = loop.time(
                    iters=4 if args.smoke else iters.get(arm),
                    repeats=2 if args.smoke else 5,
                    target_seconds=0.25,
                    expected_us_per_call=150.0,
                )
                iters[arm] = timing.calls_per_sample
                rows.append(
                    dict(
                        case=setup.case,
                        arm=arm,
                        round=round_index,
                        splits=int(np.asarray(plan.work_request).shape[0]),
                        write_final=bool(plan.write_final),
                        median_us=timing.median_us,
                        min_us=timing.min_us,
                        max_us=timing.max_us,
                        kv_bytes=setup.kv_bytes_per_set,
                        **params,
                    )
                )
                print(
                    f"{setup.case:>16} {arm:>20} r{round_index} {timing.median_us:9.2f} us "
                    f"[{timing.min_us:.2f}, {timing.max_us:.2f}]",
                    flush=True,
                )
        setup.delete()
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "decode_clamp_probe.json").write_text(json.dumps(rows, indent=1))
    print("\ncase              " + "".join(f"{a:>15}" for a in loops))
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for arm in loops:
            meds = [r["median_us"] for r in rows if r["case"] == case and r["arm"] == arm]
            cells.append("/".join(f"{m:.1f}" for m in meds))
        print(f"{case:<18}" + "".join(f"{c:>15}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
