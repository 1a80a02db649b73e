"""Probe: the Mosaic GPU decode kernel (``kernels_pallas/paged_decode_mgpu.py``) on the H200,
checked against and timed beside the Triton kernel (issue 16).

For each case of ``CASES`` (32 query heads, 8 KV heads, head_dim 128, page 16, bfloat16, the
inputs of ``bench.harness.attention_inputs.make_attention_setup``) and one plan from
``paged.plan_decode`` (the planner's default split, the one the Triton kernel runs), every arm
runs the whole decode: the kernel, plus ``merge_partial_states`` when the plan splits.

- ``triton``: ``kernels_pallas/paged_decode.py`` with the launch parameters
  ``paged.decode`` picks (``decode_launch_parameters``);
- ``mgpu:[ring.]<p path>.p<pages_per_step>.s<num_stages>``: the Mosaic GPU kernel with the
  softmax weights fed to ``p @ V`` from registers (``reg``, the compiled default) or through
  shared memory (``smem``, the interpretable path), on ``emit_pipeline`` (no prefix: one WGMMA
  pair a page) or the hand-written ring (``ring.``: one WGMMA pair over a step's pages), a few
  pipeline shapes (``VARIANTS``). Each Mosaic GPU row records its shared memory a program and
  the programs an SM that allows (``smem_bytes``, ``programs_per_sm``).

First every arm's output is compared with the Triton arm's (largest absolute difference of
``o``, and of the LSE, printed); an arm whose compilation or run fails is reported with its
error and left out, never stopping the probe; an arm further than ``MAX_DIFFERENCE`` from the
Triton output is reported as a MISMATCH and not timed. Then each arm is timed with the suite's
method (``bench.harness.timing.TimedLoop``: rotating input sets over one pool for a cold L2,
dispatch amortized in one jitted loop, median of repeats), a table is printed last, and the
rows go to ``--out/mgpu_decode_probe.json``.

Usage (GPU): ``PYTHONPATH=. python3 -m bench.probes.mgpu_decode --out DIR`` (``--cases 4x1024,
32x4096`` for a subset, ``--variants reg.p1.s4,ring.reg.p4.s3``, ``--max-grid N`` to plan for a
different grid; ``--api`` adds the public ``paged.decode_attention`` arms ``api:pallas`` and
``api:pallas_mgpu``, ``--api-variant ring.reg.p4.s3`` runs the latter with that pipeline,
pages a step and stages instead of ``paged.decode.MGPU_LAUNCH_PARAMETERS``; its p path
follows the platform). ``--smoke`` runs one tiny case in Mosaic GPU's interpret mode on a CPU:
the checks and the code paths, no figures (``tests/test_bench.py`` runs it).

``--sweep`` times ``SWEEP_VARIANTS`` beside the Triton kernel on the standard grid's ten cases
(``SWEEP_CASES``; ``--cases`` for a part), each arm timed with 3 repeats of 0.15 s programs,
and prints, after the full table, the fastest Mosaic GPU arm of each case. It starts no arm
after ``--budget-s`` (480 s by default): those rows say ``skipped`` and the last line lists
their cases, for a second run with ``--cases``. Its length, estimated (not measured): about 4 s
an arm (two compilations, the checking call's and the timed loop's, of 1 to 2 s each; 2 warm-up
and 3 timed programs of 0.15 s; a first sizing program), 10 cases x 9 arms = 90 arms, about
6 minutes, plus building the cases' rotating inputs (up to 537 MB a set) and the Triton
compilations, about 7 minutes in all; the budget keeps it under 8.5.

``--merge-fold`` times the merge both ways (issue 16) on ``MERGE_FOLD_CASES`` (B = 1 and 4 at
4096 and 32768 tokens, where the planner splits every request): ``MERGE_FOLD_VARIANTS``, each
pipeline with the separate merge kernel (``mgpu:reg.p2.s3``) and with the merge folded into the
decode launch (``mgpu:reg.p2.s3.folded``, ``paged_decode_mgpu(merge="folded")``), each checked
against the Triton arm before it is timed, and a last table of separate against folded per
case. About 4 s an arm, 4 cases x 5 arms, about 2 minutes (estimated). ``--smoke
--merge-fold`` runs its interpretable pair on the smoke case.

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
import time
import traceback
from typing import NamedTuple

import jax
import numpy as np

import paged
import paged.decode as decode_module
from bench.harness.attention_inputs import make_attention_setup
from bench.harness.timing import TimedLoop
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.paged_decode import paged_decode, token_major
from kernels_pallas.paged_decode_mgpu import (
    paged_decode_mgpu,
    programs_per_sm,
    smem_bytes_per_program,
)
from paged.attention_reference import decode_attention_reference

CASES = ((1, 4096), (4, 1024), (4, 32768), (32, 4096), (256, 512))
# The standard grid (B x ctx), every case a --sweep times.
SWEEP_CASES = (
    (1, 4096),
    (1, 32768),
    (4, 1024),
    (4, 4096),
    (4, 16384),
    (4, 32768),
    (32, 4096),
    (64, 2048),
    (128, 1024),
    (256, 512),
)
SMOKE_CASE = (2, 70)  # a partly filled last page; split by the smoke plan
SMOKE_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_dim=64)


class Variant(NamedTuple):
    """One static configuration of the Mosaic GPU kernel: the p path (``reg``: softmax weights
    fed to ``p @ V`` from registers; ``smem``: through shared memory), pages a step, pipeline
    stages, and the pipeline (``emit``: ``plgpu.emit_pipeline``, one WGMMA pair a page;
    ``ring``: the hand-written ring, one WGMMA pair over the step's pages)."""

    probs_path: str
    pages_per_step: int
    num_stages: int
    pipeline: str = "emit"
    merge: str = "separate"  # a split plan: merge_partial_states after, or "folded" in-launch

    @property
    def name(self) -> str:
        """``reg.p2.s3`` (emit_pipeline, the first probe's names) or ``ring.reg.p4.s3``, with
        ``.folded`` when the kernel merges a split plan itself (``merge="folded"``)."""
        prefix = "" if self.pipeline == "emit" else f"{self.pipeline}."
        suffix = ".folded" if self.merge == "folded" else ""
        return f"{prefix}{self.probs_path}.p{self.pages_per_step}.s{self.num_stages}{suffix}"


def parse_variant(name: str) -> Variant:
    """``Variant`` from its name (``reg.p1.s4``, ``ring.reg.p4.s3``, ``reg.p2.s3.folded``).

    Raises:
      ValueError: for a name of another form (naming it).
    """
    parts = name.split(".")
    merge = "folded" if parts[-1:] == ["folded"] else "separate"
    if merge == "folded":
        parts.pop()
    pipeline = parts.pop(0) if len(parts) == 4 else "emit"
    if (
        len(parts) != 3
        or pipeline not in ("emit", "ring")
        or parts[0] not in ("reg", "smem")
        or not (parts[1][:1] == "p" and parts[1][1:].isdigit())
        or not (parts[2][:1] == "s" and parts[2][1:].isdigit())
    ):
        raise ValueError(
            f"--variants: {name!r} is not [emit.|ring.]<reg|smem>.p<pages>.s<stages>[.folded]"
        )
    return Variant(parts[0], int(parts[1][1:]), int(parts[2][1:]), pipeline, merge)


# The register path at a few pipeline shapes, the shared-memory path at two (what it costs next
# to the registers); the ring at a few.
VARIANTS = (
    Variant("reg", 1, 4),
    Variant("reg", 1, 6),
    Variant("reg", 2, 3),
    Variant("reg", 2, 4),
    Variant("smem", 1, 4),
    Variant("smem", 2, 3),
    Variant("reg", 4, 3, "ring"),
    Variant("reg", 8, 2, "ring"),
)
# The --sweep grid: the first probe's best emit_pipeline shape as the baseline, and the ring on
# the register path over shapes that fit, from three programs an SM (ring.p1.s6, 67 KiB) and
# two (p2.s4, p4.s2: 83 KiB) to one (p4.s3 115 KiB up to p8.s3 211 KiB;
# kernels_pallas.paged_decode_mgpu.smem_bytes_per_program), steps of 16 to 128 keys (one
# WGMMA pair a step), 1 to 5 steps in flight behind the one computed.
SWEEP_VARIANTS = (
    Variant("reg", 2, 3),
    Variant("reg", 1, 6, "ring"),
    Variant("reg", 2, 4, "ring"),
    Variant("reg", 4, 2, "ring"),
    Variant("reg", 4, 3, "ring"),
    Variant("reg", 4, 5, "ring"),
    Variant("reg", 8, 2, "ring"),
    Variant("reg", 8, 3, "ring"),
)
# --merge-fold (issue 16: the merge folded into the decode launch, measured both ways at B = 1
# and B = 4, where the planner splits every request and the merge launch and the partial
# states' round trip are a visible share of the call): the decode path's pipeline and the
# ring's 4-page step, each with the separate merge kernel and with the merge folded in.
MERGE_FOLD_CASES = ((1, 4096), (1, 32768), (4, 4096), (4, 32768))
MERGE_FOLD_VARIANTS = (
    Variant("reg", 2, 3),
    Variant("reg", 2, 3, merge="folded"),
    Variant("reg", 4, 3, "ring"),
    Variant("reg", 4, 3, "ring", merge="folded"),
)
SMOKE_MERGE_FOLD_VARIANTS = (Variant("smem", 1, 4), Variant("smem", 1, 4, merge="folded"))
SWEEP_BUDGET_SECONDS = 480.0  # a sweep stops starting arms after this (the rest: "skipped")
# The smoke run's arms: the interpretable path twice, and one register variant, whose refusal in
# interpret mode exercises the report of a failed arm (the smoke sweep runs the ring).
SMOKE_VARIANTS = (Variant("smem", 1, 4), Variant("smem", 2, 3), Variant("reg", 1, 4))
# The smoke sweep: one interpretable ring arm, and one over the shared-memory limit, whose
# refusal is reported, not fatal.
SMOKE_SWEEP_VARIANTS = (Variant("smem", 4, 2, "ring"), Variant("smem", 8, 8, "ring"))
H200_SMS = 132  # when the device does not say (interpreted runs)
MAX_DIFFERENCE = 5e-2  # of o against the Triton kernel's (bfloat16 outputs of order 1)


def variant_name(probs_path: str, pages_per_step: int, num_stages: int, pipeline="emit") -> str:
    return Variant(probs_path, pages_per_step, num_stages, pipeline).name


def decode_step(kernel, setup, plan, interpret):
    """``step(set_index, operands) -> (o, lse)``: one whole decode of set ``set_index``
    (the kernel, then the merge when the plan splits, unless the kernel folds it in: an arm
    whose ``folds_merge`` is set gets the plan's ``merge_indptr`` and returns final outputs)."""
    folds_merge = getattr(kernel, "folds_merge", False)

    def step(set_index, operands):
        queries, k_pages, v_pages, page_indices, plan = operands
        extra = dict(merge_indptr=plan.merge_indptr) if folds_merge else {}
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
            **extra,
        )
        if not plan.write_final and not folds_merge:
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


class PublicPath(NamedTuple):
    """An arm that calls ``paged.decode_attention`` itself, with this ``backend``."""

    backend: str


def api_step(backend, setup):
    """``step(set_index, operands) -> (o, lse)``: the public ``paged.decode_attention`` on set
    ``set_index`` with the plan (validation, the kernel, the merge: what a user calls)."""

    def step(set_index, operands):
        queries, k_pages, v_pages, page_indices, plan = operands
        table = paged.PageTable(
            setup.page_indptr[set_index],
            page_indices[set_index],
            setup.last_page_len[set_index],
            setup.page_size,
        )
        return paged.decode_attention(
            queries[set_index],
            paged.KVCache(k_pages, v_pages, "HND"),
            table,
            plan=plan,
            backend=backend,
            return_lse=True,
        )

    return step


def arms_for(setup, plan, variants, interpret, *, public_path=False):
    """name -> kernel callable (keyword launch parameters bound)."""
    params = decode_module.decode_launch_parameters(
        plan, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, setup.page_size
    )

    def triton(*args, **kwargs):
        return paged_decode(*args, layout="HND", **kwargs, **params)

    arms = {"triton": triton}
    for variant in variants:

        def mgpu(*args, variant=variant, **kwargs):
            return paged_decode_mgpu(
                *args,
                pages_per_step=variant.pages_per_step,
                num_stages=variant.num_stages,
                probs_in_smem=variant.probs_path == "smem",
                pipeline=variant.pipeline,
                merge=variant.merge,
                **kwargs,
            )

        mgpu.folds_merge = variant.merge == "folded"
        arms["mgpu:" + variant.name] = mgpu
    if public_path:
        arms["api:pallas"] = PublicPath("pallas")
        arms["api:pallas_mgpu"] = PublicPath(decode_module.MOSAIC_GPU_BACKEND)
    return arms, params


def shared_memory_of(arm: str, setup, plan) -> dict:
    """A Mosaic GPU arm's shared memory a program, the programs an SM that allows, and the
    waves of the launch (``work items x KV heads`` programs over ``SMs x programs_per_sm``; a
    second, partial wave idles SMs at the end); empty for the Triton arm."""
    if not arm.startswith("mgpu:"):
        return {}
    write_final = bool(plan.write_final)
    variant = parse_variant(arm.removeprefix("mgpu:"))
    smem = smem_bytes_per_program(
        setup.head_dim,
        setup.queries.dtype,
        pages_per_step=variant.pages_per_step,
        num_stages=variant.num_stages,
        probs_in_smem=variant.probs_path == "smem",
        pipeline=variant.pipeline,
        write_final=write_final,
    )
    per_sm = programs_per_sm(smem)
    # Mosaic GPU launches every work item of the plan's bucket, padding included.
    programs = int(np.asarray(plan.work_request).shape[0]) * setup.num_kv_heads
    num_sms = getattr(jax.devices()[0], "core_count", None) or H200_SMS
    waves = programs / (num_sms * per_sm) if per_sm else float("inf")
    return dict(smem_bytes=smem, programs_per_sm=per_sm, waves=round(waves, 2))


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
    # (pipeline, pages_per_step): emit_pipeline at one and two pages a step; the ring's own
    # copies at two and four (the last step of an item partly past its end, index windows
    # fetched ahead, the last window's copy running past page_indices).
    pipelines = [("emit", 1), ("ring", 4)]
    if not smoke:
        pipelines += [("emit", 2), ("ring", 2)]
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
                for pipeline, pages_per_step in pipelines:
                    o, _ = run_decode(
                        q, cache, table, plan, probs_path, pages_per_step, interpret, pipeline
                    )
                    o = np.asarray(o, np.float32)
                    error = np.linalg.norm(o - expected) / np.linalg.norm(expected)
                    worst = max(worst, float(error))
                    print(
                        f"q_len={q_len} {split} {pipeline}.{probs_path}.p{pages_per_step} "
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


def run_decode(q, cache, table, plan, probs_path, pages_per_step, interpret, pipeline="emit"):
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
        # Windows of 4 page numbers with one or four pages a step: items of more pages than a
        # window (double-buffered windows); the default (the largest) with two.
        index_window=4 if pages_per_step in (1, 4) else None,
        probs_in_smem=probs_path == "smem",
        pipeline=pipeline,
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
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the standard grid's cases x SWEEP_VARIANTS, shorter timings, a time budget",
    )
    parser.add_argument("--cases", default=None, help="comma-separated BxCTX (default: CASES)")
    parser.add_argument(
        "--variants", default=None, help="comma-separated, e.g. reg.p1.s4,ring.reg.p4.s3"
    )
    parser.add_argument("--max-grid", type=int, default=None, help="plan_decode's max_grid")
    parser.add_argument(
        "--api",
        action="store_true",
        help="also time paged.decode_attention with backend='pallas' and 'pallas_mgpu'",
    )
    parser.add_argument(
        "--api-variant",
        default=None,
        help="the pipeline decode_attention's Mosaic GPU path runs in this process, e.g. "
        "ring.reg.p4.s3 (default: paged.decode.MGPU_LAUNCH_PARAMETERS)",
    )
    parser.add_argument(
        "--merge-fold",
        action="store_true",
        help="MERGE_FOLD_CASES x MERGE_FOLD_VARIANTS: the separate merge kernel against the "
        "merge folded into the decode launch",
    )
    parser.add_argument("--repeats", type=int, default=None, help="default 5, 3 with --sweep")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"start no arm after this many seconds (default {SWEEP_BUDGET_SECONDS:.0f} with "
        "--sweep, none otherwise); the rest are reported as skipped",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print full tracebacks")
    parser.add_argument(
        "--memcheck", action="store_true", help="the compute-sanitizer workload, no timing"
    )
    args = parser.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    if args.memcheck:
        return memcheck_workload(interpret, args.smoke)
    started = time.monotonic()
    budget_s = args.budget_s
    if budget_s is None and args.sweep:
        budget_s = SWEEP_BUDGET_SECONDS
    repeats = args.repeats or (3 if args.sweep else 5)
    # A sweep ranks many arms: shorter timed programs (still hundreds of calls each).
    target_seconds = 0.15 if args.sweep else 0.25
    if args.smoke:
        cases = (SMOKE_CASE,)
    elif args.merge_fold:
        cases = MERGE_FOLD_CASES
    else:
        cases = SWEEP_CASES if args.sweep else CASES
    if args.cases:
        cases = tuple(tuple(int(n) for n in case.split("x")) for case in args.cases.split(","))
    if args.merge_fold:
        variants = SMOKE_MERGE_FOLD_VARIANTS if args.smoke else MERGE_FOLD_VARIANTS
    elif args.sweep:
        variants = SMOKE_SWEEP_VARIANTS if args.smoke else SWEEP_VARIANTS
    else:
        variants = SMOKE_VARIANTS if args.smoke else VARIANTS
    if args.variants:
        variants = tuple(parse_variant(name) for name in args.variants.split(","))

    if args.api_variant:  # the public path's pipeline for this run (read when it is traced)
        chosen = parse_variant(args.api_variant)
        decode_module.MGPU_LAUNCH_PARAMETERS = dict(
            pipeline=chosen.pipeline,
            pages_per_step=chosen.pages_per_step,
            num_stages=chosen.num_stages,
        )

    def out_of_time() -> bool:
        return budget_s is not None and time.monotonic() - started > budget_s

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
        arms, triton_params = arms_for(setup, plan, variants, interpret, public_path=args.api)
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
            if isinstance(kernel, PublicPath):
                step = api_step(kernel.backend, setup)
            else:
                step = decode_step(kernel, setup, plan, interpret)
            loop = TimedLoop(step, setup.num_sets, operands)
            row = dict(common, arm=arm, **shared_memory_of(arm, setup, plan))
            if out_of_time():
                row.update(status="skipped", error=f"time budget of {budget_s:.0f} s spent")
                print(f"{setup.case:>16} {arm:>22} skipped (time budget)", flush=True)
                rows.append(row)
                continue
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
            if out_of_time():
                row.update(status="skipped", error=f"time budget of {budget_s:.0f} s spent")
                print(f"{setup.case:>16} {arm:>22} timing skipped (time budget)", flush=True)
                continue
            try:
                timing = loop.time(
                    # Smoke: one call a program (the timing path runs; its figure is dropped
                    # below), as every interpreted Mosaic GPU call costs seconds of CPU.
                    iters=1 if args.smoke else None,
                    repeats=1 if args.smoke else repeats,
                    target_seconds=target_seconds,
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
            sweep=args.sweep,
            merge_fold=args.merge_fold,
            repeats=repeats,
            target_seconds=target_seconds,
            budget_s=budget_s,
            elapsed_s=time.monotonic() - started,
            api_launch_parameters=dict(decode_module.MGPU_LAUNCH_PARAMETERS) if args.api else None,
            rows=rows,
        )
        (folder / "mgpu_decode_probe.json").write_text(json.dumps(document, indent=1))
    print_table(rows, arm_names, smoke=args.smoke)
    print_best(rows)
    print_merge_fold(rows)
    skipped = sorted({row["case"] for row in rows if row["status"] == "skipped"})
    print(f"\n# {time.monotonic() - started:.0f} s" + (f"; skipped: {skipped}" if skipped else ""))
    return 0


def print_best(rows):
    """Per case: the Triton kernel's time, the fastest Mosaic GPU arm, its time, TB/s, the
    Triton time over it (above 1: the Mosaic GPU arm is faster), and its shared memory a
    program and waves."""
    timed = [row for row in rows if "median_us" in row]
    if not timed:
        return
    print("\n# fastest Mosaic GPU arm per case")
    print(
        f"{'case':<18}{'triton us':>11}{'best arm':>24}{'us':>9}{'TB/s':>8}{'speedup':>9}"
        f"{'KiB':>6}{'waves':>7}"
    )
    for case in dict.fromkeys(row["case"] for row in timed):
        triton = [r["median_us"] for r in timed if r["case"] == case and r["arm"] == "triton"]
        mgpu = [r for r in timed if r["case"] == case and r["arm"].startswith("mgpu:")]
        if not mgpu:
            continue
        best = min(mgpu, key=lambda r: r["median_us"])
        triton_us = triton[0] if triton else float("nan")
        print(
            f"{case:<18}{triton_us:>11.1f}{best['arm']:>24}{best['median_us']:>9.1f}"
            f"{best['tbps']:>8.3f}{triton_us / best['median_us']:>9.2f}"
            f"{best['smem_bytes'] // 1024:>6}{best['waves']:>7.2f}"
        )


def print_merge_fold(rows):
    """Per case and pipeline with both merges timed: the separate merge's time, the folded
    one's, and their ratio (above 1: folding the merge in is faster)."""
    timed = {(row["case"], row["arm"]): row["median_us"] for row in rows if "median_us" in row}
    pairs = [
        (case, arm, folded)
        for (case, folded) in timed
        if folded.endswith(".folded") and (case, arm := folded.removesuffix(".folded")) in timed
    ]
    if not pairs:
        return
    print("\n# merge: separate kernel vs folded into the decode launch")
    print(f"{'case':<18}{'arm':>24}{'separate us':>13}{'folded us':>11}{'speedup':>9}")
    for case, arm, folded in pairs:
        separate_us, folded_us = timed[(case, arm)], timed[(case, folded)]
        print(
            f"{case:<18}{arm:>24}{separate_us:>13.1f}{folded_us:>11.1f}"
            f"{separate_us / folded_us:>9.2f}"
        )


def print_table(rows, arm_names, *, smoke):
    """Median us per case and arm (``failed``/``mismatch``/``skipped`` where it did not run,
    ``-`` in a smoke run)."""
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
