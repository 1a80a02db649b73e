"""The ``decode`` suite: decodelab's fused paged decode beside the peers, in the same run.

Standard grid (32 query heads, 8 KV heads, head_dim 128, page_size 16, bfloat16, HND pool),
cold L2, dispatch amortized (``bench.harness``). Bytes = K and V of the real tokens. Arms:

- ``decodelab``: the public ``paged.decode_attention(..., plan=plan)`` with the plan
  ``paged.plan_decode`` made for the step, on the kernel ``backend="auto"`` runs on a GPU for
  these shapes (``api_backend``: the Mosaic GPU kernel since it was measured faster): what a
  user gets. (The CPU dry run interprets the Triton kernel here: see ``api_backend``.)
- ``decodelab_triton`` (while ``auto`` runs the Mosaic GPU kernel): the same API with
  ``backend="pallas"`` and the plan cut for it, the Triton kernel that ``auto`` ran before, which goes once the Mosaic
  GPU kernel is faster on every case.
- ``decodelab_kernel`` (only where the planner splits): the decode kernel alone, writing its
  partial states, with the merge launch excluded: how much of the API's time is the KV stream.
  (The committed 2026-11-30 report still times it on unsplit cases too, where it is the same
  program as the API arm with another label; later runs note it instead.)
- ``decodelab_no_split`` and ``decodelab_split16`` (only where the planner splits): the same API
  with "never split" and "16 chunks a request", to show the planner's choice against both. Where
  the planner's choice coincides with one of them, a note says so instead of timing it twice.
  Each arm's plan is cut for its own kernel (``plan_for_backend``).
- ``decodelab_grid_rule`` (where the Mosaic GPU kernel's cap of 16 splits a request changes the
  plan: one request): the same kernel on the plan of the grid rule alone, what the cap gains.
- the peers (``bench.suites.peers.peer_attention_results``): XLA gather + softmax, JAX's Pallas
  ``paged_attention`` at its best ``k_splits``, PyTorch gather + SDPA.
- ``decodelab (repeat)``: the API arm timed again at the end of the case, the noise level.

On a GPU the ``decodelab`` arm also carries ``device_us_per_call``: the device time a call spends
in the decode kernel and the merge, in every other device op (the timed loop's own slicing and
checksum among them) and its span, read from a profiler trace (``device_time_of``). The timed
figure stays the one compared; this says how much of a small case's call is the kernel.

Each decodelab arm's attribution names the kernels its program calls (read from the lowered
program: Triton and Mosaic GPU custom calls) and the number of splits, so no two arms can be
confused.

Several new tokens per request (speculative verification of ``L - 1`` drafts), cases
``"B=64 ctx=4096 q_len=L"`` for ``L`` in ``MULTI_TOKEN_Q_LENS``: every request's last ``L``
tokens attend causally (``q [B, L, H, D]``). Bytes are still K and V of the real tokens read
once (the floor: one read serves all ``L`` queries); the ``q_len=1`` case, timed through the
same 4-D path, is the one-token step the others are compared with (``vs_q_len_1``). Arms:

- ``decodelab``: the public API with the step's plan, as above; ``decodelab_triton`` likewise.
- ``xla_gather``: the same function written the obvious way in ``jnp`` and compiled by XLA
  (``xla_gather_causal_attention``: gather each request's pages, einsum, causal mask,
  softmax, einsum), which is also the float32 output the API arm is checked against.
  (``paged``'s own reference is not timed at these shapes: it attends every request over the
  whole table's keys, a test oracle whose cost grows with ``B^2``.)
- ``decodelab (repeat)``.

``--tune`` runs the cases of ``TUNE_CASES`` only (a dry run: ``DRY_RUN_TUNE_GRID``) and also
sweeps the kernel's launch parameters (pages per step, warps, pipeline stages) and the
planner's programs per SM there, records every figure in the decodelab row's ``kernel_sweep``
field and names the best in the notes; the chosen values are then written into
``kernels_pallas/paged_decode_tuning.py`` by hand, citing the report.
"""

from __future__ import annotations

import gc
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.harness import (
    CaseResult,
    CopyCeiling,
    RunOptions,
    TimedLoop,
    expected_us,
    repeat_arm,
    report,
)
from bench.harness.attention_inputs import (
    ATTENTION_GRID,
    DRY_RUN_GRID,
    DRY_RUN_SHAPE,
    QUICK_GRID,
    STANDARD_SHAPE,
    AttentionSetup,
    case_name,
    kv_bytes_per_set,
    make_attention_setup,
)
from bench.harness.device_trace import split_by_kernel, trace_device_time
from bench.suites import SuiteOutput, peers
from kernels_pallas import paged_decode_tuning as tuning
from kernels_pallas.merge_states import merge_partial_states
from kernels_pallas.paged_decode import paged_decode
from kernels_pallas.paged_decode_mgpu import paged_decode_mgpu
from paged.decode import (
    MOSAIC_GPU_BACKEND,
    decode_kernel_for,
    decode_launch_parameters,
    mgpu_decode_launch_parameters,
)

EXPECTED_TBPS = 2.5  # prior for sizing the first timed program
DISAGREEMENT_TOLERANCE = 0.05  # max |ours - xla_gather| on bfloat16 outputs of magnitude < 1
FIXED_SPLITS_ARM = 16
# The decodelab arm's device time is read from a trace of a program of this many calls, and
# split into the kernels whose names contain one of these and everything else.
DEVICE_TRACE_CALLS = 64
DECODELAB_KERNEL_NAMES = ("paged_decode", "merge_partial_states")
DRY_RUN_MAX_CONTEXT = max(context for _, context in DRY_RUN_GRID)

TUNE_CASES = ((1, 32768), (4, 4096), (32, 4096), (256, 512))
# Launch candidates. The first sweep (2026-11-30) tried pages per step 4/8/16 x warps 4/8 x
# pipeline stages 1/2/3, the second also loading the next step's page numbers ahead (no gain);
# one stage won everywhere, so the sweep keeps one stage and a two-stage control.
TUNE_KERNEL_CANDIDATES = [
    {"pages_per_step": p, "num_warps": w, "num_stages": 1} for p in (4, 8, 16) for w in (4, 8)
] + [{"pages_per_step": p, "num_warps": 4, "num_stages": 2} for p in (4, 8, 16)]
TUNE_BLOCKS_PER_SM = (1, 2, 4)
LAUNCH_PARAMETERS = ("pages_per_step", "num_warps", "num_stages")
DRY_RUN_KERNEL_CANDIDATES = [{"pages_per_step": p, "num_warps": 4, "num_stages": 1} for p in (4, 8)]
DRY_RUN_BLOCKS_PER_SM = (1, 2)
# A tuning dry run sweeps one case of the dry-run grid: a batch of 2 and a partly filled last
# page. Its sweep code is the same for every case, and each interpreted candidate compiles in
# CPU seconds; the plain dry run still times every case of DRY_RUN_GRID.
DRY_RUN_TUNE_GRID = ((2, 40),)

# Several new tokens per request: a batch that fills the GPU without splitting, long contexts.
MULTI_TOKEN_GRID = ((64, 4096),)
MULTI_TOKEN_Q_LENS = (1, 2, 5, 9)
DRY_RUN_MULTI_TOKEN_GRID = ((2, 40),)
DRY_RUN_MULTI_TOKEN_Q_LENS = (1, 3)
EXPECTED_XLA_GATHER_TBPS = 0.7  # prior for sizing the first timed program of the XLA arm


def run(options: RunOptions, ceiling: CopyCeiling) -> SuiteOutput:
    """Times decodelab's arms and the peers on each case of the grid (module docstring)."""
    notes: list[str] = []
    results: list[CaseResult] = []
    sweeps: dict[str, list[dict[str, Any]]] = {}
    shape = DRY_RUN_SHAPE if options.dry_run else STANDARD_SHAPE
    grid = DRY_RUN_GRID if options.dry_run else QUICK_GRID if options.quick else ATTENTION_GRID
    if options.tune:  # a tuning run times the tuned cases only
        grid = DRY_RUN_TUNE_GRID if options.dry_run else TUNE_CASES
    if options.q_len_only:
        grid = ()
    if options.interpret:
        notes.append(
            "interpret mode: the decodelab arms interpret the Triton kernel (Mosaic GPU's "
            "interpreter takes seconds a call); a GPU run times the kernel backend='auto' runs "
            "there (the Mosaic GPU one at the standard shapes) and the Triton one beside it"
        )
    for batch, context in grid:
        num_sets = options.num_sets_for(kv_bytes_per_set(batch, context, **shape))
        report.print_progress(
            f"{case_name(batch, context)}: setting up {num_sets} rotating sets, then timing "
            + ("the tuning sweep" if options.tune else "decodelab's arms and the peers")
        )
        setup = make_attention_setup(
            batch, context, **shape, layouts=("HND", peers.PEER_ATTENTION_LAYOUT), num_sets=num_sets
        )
        try:
            rows = decodelab_results(setup, options, ceiling.tbps, notes)
            if options.tune and (options.dry_run or (batch, context) in TUNE_CASES):
                sweeps[setup.case] = tuning_sweep(setup, options)
                rows[0].extra["kernel_sweep"] = sweeps[setup.case]
            # A tuning run compares our parameters with each other; the peers run in the full run.
            peer_rows = (
                []
                if options.tune
                else peers.peer_attention_results(
                    setup, options, ceiling.tbps, notes=notes, repeat_reference_arm=False
                )
            )
            repeat = _api_result(setup, options, ceiling.tbps, repeat=rows[0])
            results += rows + peer_rows + [repeat]
            report.print_results([*rows, repeat])
        finally:
            gc.collect()
            setup.delete()
    if not options.tune:  # a tuning run times the one-token cases it tunes
        multi_grid = DRY_RUN_MULTI_TOKEN_GRID if options.dry_run else MULTI_TOKEN_GRID
        q_lens = DRY_RUN_MULTI_TOKEN_Q_LENS if options.dry_run else MULTI_TOKEN_Q_LENS
        for batch, context in multi_grid:
            results += multi_token_results(
                batch, context, q_lens, shape, options, ceiling.tbps, notes
            )
    if sweeps:
        notes += summarize_sweeps(sweeps)
    return SuiteOutput(results=results, notes=notes)


# ----------------------------------------------------------------------------------------------
# Arms


def _table_of_set(page_indptr, page_indices, last_page_len, set_index, page_size):
    """Rotating set ``set_index``'s page table, from the stacked ``[num_sets, ...]`` arrays."""
    return paged.PageTable(
        page_indptr[set_index], page_indices[set_index], last_page_len[set_index], page_size
    )


def plan_for(setup: AttentionSetup, **overrides) -> paged.DecodePlan:
    """The plan of set 0; every set has the same lengths, so one plan serves them all (a plan
    holds positions in ``page_indices``, never page numbers). Dry-run contexts are a few pages,
    shorter than the smallest chunk worth splitting; they split at 1 page so that the split
    arms run too."""
    if setup.context <= DRY_RUN_MAX_CONTEXT:
        overrides.setdefault("min_chunk_pages", 1)
    plan = paged.plan_decode(
        _table_of_set(
            setup.page_indptr, setup.page_indices, setup.last_page_len, 0, setup.page_size
        ),
        setup.num_q_heads,
        setup.num_kv_heads,
        setup.head_dim,
        **overrides,
    )
    return jax.device_put(plan)  # on the device once, not copied by every timed program


def planned_kernel(backend: str) -> str:
    """The kernel a plan is cut for (``paged.plan_decode``'s ``kernel``) on a backend."""
    return "paged_decode_mgpu" if backend == MOSAIC_GPU_BACKEND else "paged_decode"


def plan_for_backend(setup: AttentionSetup, backend: str, **overrides) -> paged.DecodePlan:
    """``plan_for`` cut for the kernel ``backend`` runs: each arm gets its own kernel's plan
    (the Mosaic GPU kernel cuts a request into 16 items at most, the Triton one by the grid
    rule alone)."""
    return plan_for(setup, kernel=planned_kernel(backend), **overrides)


def _operands(setup: AttentionSetup, plan: paged.DecodePlan):
    k_pages, v_pages = setup.pool("HND")
    return (
        setup.queries,
        k_pages,
        v_pages,
        setup.page_indptr,
        setup.page_indices,
        setup.last_page_len,
        plan,
    )


def auto_backend(setup: AttentionSetup) -> str:
    """The kernel backend ``backend="auto"`` runs on a GPU for the case's shapes
    (``paged.decode.decode_kernel_for``): ``"pallas_mgpu"`` (the Mosaic GPU kernel) or
    ``"pallas"`` (the Triton kernel)."""
    k_pages, v_pages = setup.pool("HND")
    kernel = decode_kernel_for(setup.queries[0], paged.KVCache(k_pages, v_pages, "HND"), "auto")
    return MOSAIC_GPU_BACKEND if kernel == "paged_decode_mgpu" else "pallas"


def api_backend(setup: AttentionSetup, options: RunOptions) -> str:
    """The backend of the ``decodelab`` arm: on a GPU, ``auto_backend`` by name (``"auto"``
    itself would do the same there). In interpret mode (the CPU dry run) the Triton kernel:
    Mosaic GPU's interpreter takes seconds a call, too slow for the timing loops, so the
    Mosaic GPU arms are checked there by their own tests instead
    (``tests/test_bench.py::test_decode_suite_mosaic_gpu_arms_run_interpreted``)."""
    return "pallas" if options.interpret else auto_backend(setup)


def api_arms(backend: str) -> list[tuple[str, str]]:
    """``(arm, backend)`` of the API arms a case times: ``decodelab`` on ``backend``, and
    ``decodelab_triton`` beside it while that is not already the Triton kernel."""
    arms = [("decodelab", backend)]
    if backend != "pallas":
        arms.append(("decodelab_triton", "pallas"))
    return arms


def api_loop(
    setup: AttentionSetup,
    plan: paged.DecodePlan,
    queries: jax.Array | None = None,
    backend: str = "pallas",
) -> TimedLoop:
    """One call = the public ``paged.decode_attention(..., backend=backend)`` on rotating set
    ``set_index``.

    ``queries``: ``[num_sets, B, L, H, D]`` for several new tokens a request (default: the
    setup's one-token ``[num_sets, B, H, D]``).
    """

    def step(set_index, operands):
        queries, k_pages, v_pages, page_indptr, page_indices, last_page_len, plan = operands
        cache = paged.KVCache(k_pages, v_pages, "HND")
        return paged.decode_attention(
            queries[set_index],
            cache,
            _table_of_set(page_indptr, page_indices, last_page_len, set_index, setup.page_size),
            plan=plan,
            backend=backend,
        )

    operands = _operands(setup, plan)
    if queries is not None:
        operands = (queries, *operands[1:])
    return TimedLoop(step, setup.num_sets, operands)


def kernel_loop(
    setup: AttentionSetup,
    plan: paged.DecodePlan,
    params: dict[str, int],
    *,
    include_merge: bool,
    interpret: bool,
    decode=paged_decode,
    merge=merge_partial_states,
    takes_table: bool = True,
) -> TimedLoop:
    """One call = the raw decode kernel with ``params`` (and the merge, if asked and needed).

    ``decode`` and ``merge`` are the kernels' wrappers (default: this tree's); a probe passes
    other versions of them (``bench/probes/decode_clamps.py``), whose ``decode`` may predate
    the table operands (``takes_table=False``)."""

    def step(set_index, operands):
        queries, k_pages, v_pages, page_indptr, page_indices, last_page_len, plan = operands
        table = (
            dict(page_indptr=page_indptr[set_index], last_page_len=last_page_len[set_index])
            if takes_table
            else {}
        )
        o, lse = decode(
            queries[set_index],
            k_pages,
            v_pages,
            page_indices[set_index],
            plan.work_request,
            plan.work_page_start,
            plan.work_page_end,
            plan.work_last_page_len,
            layout="HND",
            sm_scale=setup.sm_scale,
            logits_soft_cap=None,
            write_final=plan.write_final,
            interpret=interpret,
            **table,
            **params,
        )
        if include_merge and not plan.write_final:
            o, lse = merge(
                o,
                lse,
                plan.merge_indptr,
                num_q_heads=setup.num_q_heads,
                out_dtype=setup.queries.dtype,
                interpret=interpret,
            )
        return o, lse

    return TimedLoop(step, setup.num_sets, _operands(setup, plan))


def mosaic_gpu_kernel_names(lowered_text: str, prefix: str) -> list[str]:
    """Names of the Mosaic GPU kernels starting with ``prefix`` that a lowered program calls.

    A Mosaic GPU kernel lowered for a GPU is a ``mosaic_gpu_v2`` custom call whose module
    holds its ``kernel_name`` (e.g. ``paged_decode_mgpu_ring_p4_s2_preg_partial``), beside
    symbols derived from it (``..._mosaic_gpu``, ``..._0``) that are dropped here."""
    if "mosaic_gpu" not in lowered_text:
        return []
    found = set(re.findall(rf"{re.escape(prefix)}_\w+", lowered_text))
    return sorted(n for n in found if not re.search(r"_mosaic_gpu$|_\d+$", n))


def kernel_names(loop: TimedLoop, options: RunOptions) -> str:
    """The kernels a loop's program calls, e.g. ``paged_decode_HND_p8_w4_s2_partial+
    merge_partial_states`` (Triton) or ``paged_decode_mgpu_ring_p4_s2_preg_partial+
    merge_partial_states`` (``interpret`` where no kernel is compiled)."""
    if options.interpret:
        return "interpret"
    text = loop.lowered_text()
    names = (
        mosaic_gpu_kernel_names(text, "paged_decode_mgpu")
        + peers.triton_kernel_names(text, "paged_decode")
        + peers.triton_kernel_names(text, "merge_partial_states")
    )
    return "+".join(names) if names else "no-kernel-found"


def _splits_label(plan: paged.DecodePlan) -> str:
    splits = plan.splits_per_request()
    low, high = int(splits.min()), int(splits.max())
    return f"splits={low}" if low == high else f"splits={low}..{high}"


def _plan_fields(plan: paged.DecodePlan) -> dict[str, Any]:
    return {
        "splits": int(plan.splits_per_request().max()),
        "chunk_pages": int(plan.chunk_pages),
        "num_work_items": int(plan.num_work_items),
        "write_final": plan.write_final,
    }


def _timed_row(
    setup, options, ceiling_tbps, loop, arm, prefix, plan, iters=None, case=None, **extra
):
    timing = options.time(
        loop, expected_us_per_call=expected_us(setup.kv_bytes_per_set, EXPECTED_TBPS), iters=iters
    )
    attribution = f"{prefix}{kernel_names(loop, options)}:{_splits_label(plan)}"
    return CaseResult.from_timing(
        case or setup.case,
        arm,
        attribution,
        timing,
        setup.kv_bytes_per_set,
        ceiling_tbps,
        **_plan_fields(plan),
        **extra,
    )


def _launch_parameters(setup: AttentionSetup, plan: paged.DecodePlan) -> dict[str, int]:
    """The launch parameters ``paged.decode_attention`` picks for one new token under ``plan``."""
    return decode_launch_parameters(
        plan, setup.num_q_heads, setup.num_kv_heads, setup.head_dim, setup.page_size
    )


def _api_result(
    setup, options, ceiling_tbps, *, plan=None, arm="decodelab", repeat=None, backend=None
):
    """One timed row of the public API (``backend`` default: ``api_backend``)."""
    plan = plan_for(setup) if plan is None else plan
    backend = api_backend(setup, options) if backend is None else backend
    loop = api_loop(setup, plan, backend=backend)
    iters = None if repeat is None else repeat.extra["iters"]
    arm = repeat_arm(repeat.arm) if repeat is not None else arm
    row = _timed_row(
        setup,
        options,
        ceiling_tbps,
        loop,
        arm,
        f"paged.decode_attention({backend}):",
        plan,
        iters=iters,
        backend=backend,
    )
    if arm == "decodelab" and not options.interpret:
        row.extra["device_us_per_call"] = device_time_of(loop)
    return row


def device_time_of(loop: TimedLoop) -> dict:
    """The device time a call of ``loop`` spends in decodelab's own kernels (the decode kernel,
    the merge), in every other device op (the timed loop's slicing and checksum, the call's
    small XLA ops), and its span, from a profiler trace of one program of
    ``DEVICE_TRACE_CALLS`` calls (``bench.harness.device_trace``); ``{"error": ...}`` if the
    trace fails (it never fails the suite)."""
    try:
        traced = trace_device_time(loop, DEVICE_TRACE_CALLS)
    except Exception as error:  # a figure beside the timed one: it never fails the suite
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    return split_by_kernel(traced, DECODELAB_KERNEL_NAMES)


def _mgpu_kernel(q, k_pages, v_pages, page_indices, *work, layout, **options):
    """``paged_decode_mgpu`` called as ``kernel_loop`` calls the Triton kernel: HND pages only
    (``layout`` checked), the table's lengths passed only for several tokens a request."""
    if layout != "HND":
        raise ValueError(f"layout={layout!r}: the Mosaic GPU kernel reads HND pages")
    if q.ndim == 3:  # one token a request: no causal bound, no lengths
        options.pop("page_indptr", None)
        options.pop("last_page_len", None)
    return paged_decode_mgpu(q, k_pages, v_pages, page_indices, *work, **options)


def _kernel_alone_loop(setup, plan, backend, options):
    """The API's decode kernel alone (no merge) with the launch parameters the API uses."""
    if backend == MOSAIC_GPU_BACKEND:
        params = mgpu_decode_launch_parameters(options.interpret)
        return kernel_loop(
            setup,
            plan,
            params,
            include_merge=False,
            interpret=options.interpret,
            decode=_mgpu_kernel,
        )
    return kernel_loop(
        setup,
        plan,
        _launch_parameters(setup, plan),
        include_merge=False,
        interpret=options.interpret,
    )


def decodelab_results(
    setup: AttentionSetup, options: RunOptions, ceiling_tbps: float, notes: list[str]
) -> list[CaseResult]:
    """decodelab's arms on one case: API, kernel alone, and the split policies it beat."""
    backend = api_backend(setup, options)
    plan = plan_for_backend(setup, backend)
    rows = []
    for arm, arm_backend in api_arms(backend):
        arm_plan = plan if arm_backend == backend else plan_for_backend(setup, arm_backend)
        row = _api_result(setup, options, ceiling_tbps, plan=arm_plan, arm=arm, backend=arm_backend)
        difference = peers.max_abs_difference(
            api_loop(setup, arm_plan, backend=arm_backend).output(0),
            peers.reference_output(setup),
        )
        row.extra["max_abs_difference_from_xla_gather"] = difference
        row.extra["kernel_parameters"] = (
            mgpu_decode_launch_parameters(options.interpret)
            if arm_backend == MOSAIC_GPU_BACKEND
            else _launch_parameters(setup, arm_plan)
        )
        if not difference <= DISAGREEMENT_TOLERANCE:
            notes.append(f"{setup.case}: {arm} differs from xla_gather by {difference:.3g}")
        rows.append(row)
    if plan.write_final:
        # Without a split the API runs the kernel alone: the same program, not timed twice.
        notes.append(
            f"{setup.case}: no split, so the API arm is the kernel alone; "
            "`decodelab_kernel` not timed twice"
        )
    else:
        rows.append(
            _timed_row(
                setup,
                options,
                ceiling_tbps,
                _kernel_alone_loop(setup, plan, backend, options),
                "decodelab_kernel",
                f"kernel_only({backend}, no merge):",
                plan,
                backend=backend,
            )
        )
    splits = int(plan.splits_per_request().max())
    if splits > 1:
        if plan.write_final:  # cannot happen: more than one split always merges
            raise AssertionError("a split plan must merge")
        no_split = plan_for_backend(setup, backend, max_grid=1)
        rows.append(
            _api_result(setup, options, ceiling_tbps, plan=no_split, arm="decodelab_no_split")
        )
        grid_rule = plan_for_backend(setup, "pallas")
        if backend == MOSAIC_GPU_BACKEND and not np.array_equal(
            grid_rule.splits_per_request(), plan.splits_per_request()
        ):
            # What the Mosaic GPU kernel's cap on splits a request changes: the same kernel
            # on the plan of the grid rule alone (the Triton kernel's).
            rows.append(
                _api_result(setup, options, ceiling_tbps, plan=grid_rule, arm="decodelab_grid_rule")
            )
        chunk = math.ceil(setup.pages_per_sequence / FIXED_SPLITS_ARM)
        fixed = plan_for_backend(setup, backend, fixed_split_pages=chunk)
        if np.array_equal(fixed.splits_per_request(), plan.splits_per_request()):
            notes.append(
                f"{setup.case}: the planner's split ({_splits_label(plan)}) is the "
                f"fixed-{FIXED_SPLITS_ARM} arm's; not timed twice"
            )
        else:
            rows.append(
                _api_result(
                    setup,
                    options,
                    ceiling_tbps,
                    plan=fixed,
                    arm=f"decodelab_split{FIXED_SPLITS_ARM}",
                )
            )
    else:
        notes.append(
            f"{setup.case}: the planner does not split here, so its choice is the "
            "no-split arm; not timed twice"
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Tuning


def tuning_sweep(setup: AttentionSetup, options: RunOptions) -> list[dict[str, Any]]:
    """Times the kernel (with its merge) over the launch-parameter grid, and the planner's
    programs per SM at the default launch parameters; failures are recorded, not raised."""
    candidates = DRY_RUN_KERNEL_CANDIDATES if options.dry_run else TUNE_KERNEL_CANDIDATES
    blocks_per_sm = DRY_RUN_BLOCKS_PER_SM if options.dry_run else TUNE_BLOCKS_PER_SM
    prior = expected_us(setup.kv_bytes_per_set, EXPECTED_TBPS)
    plan = plan_for(setup)
    entries = []
    planner_candidates = [{"blocks_per_sm": n} for n in blocks_per_sm]
    for candidate in candidates + planner_candidates:
        try:
            if "blocks_per_sm" in candidate:
                max_grid = candidate["blocks_per_sm"] * tuning.num_sms()
                this_plan = plan_for(setup, max_grid=max_grid)
                params = _launch_parameters(setup, this_plan)
            else:
                this_plan, params = plan, candidate
            loop = kernel_loop(
                setup, this_plan, params, include_merge=True, interpret=options.interpret
            )
            timing = options.time(loop, expected_us_per_call=prior, sweep=True)
            entries.append(
                {
                    **candidate,
                    **_plan_fields(this_plan),
                    "median_us": timing.median_us,
                    "achieved_tbps": setup.kv_bytes_per_set / timing.median_us / 1e6,
                }
            )
        except Exception as error:  # a candidate that fails to compile is recorded
            entries.append({**candidate, "error": f"{type(error).__name__}: {str(error)[:200]}"})
    for entry in entries:
        print(f"  tune {setup.case:<16} {entry}", flush=True)
    return entries


def summarize_sweeps(sweeps: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Notes naming each case's best candidates and the launch parameters with the best
    geometric-mean time over the tuned cases."""
    notes = []
    kernel_times: dict[tuple, list[float]] = {}
    for case, entries in sweeps.items():
        timed = [e for e in entries if "median_us" in e]
        kernels = [e for e in timed if "pages_per_step" in e]
        planners = [e for e in timed if "blocks_per_sm" in e]
        if kernels:
            best = min(kernels, key=lambda e: e["median_us"])
            notes.append(
                f"tune {case}: best launch {_launch_label(best)} (write_final="
                f"{best['write_final']}): {best['median_us']:.2f} us "
                f"({best['achieved_tbps']:.2f} TB/s)"
            )
        if planners:
            best = min(planners, key=lambda e: e["median_us"])
            notes.append(
                f"tune {case}: best planner blocks_per_sm={best['blocks_per_sm']} "
                f"(splits={best['splits']}): {best['median_us']:.2f} us"
            )
        for entry in kernels:
            key = (entry["write_final"], _launch_label(entry))
            kernel_times.setdefault(key, []).append(entry["median_us"])
    for write_final in (True, False):
        group = {k: v for k, v in kernel_times.items() if k[0] == write_final}
        if not group:
            continue
        most = max(len(v) for v in group.values())
        complete = {k: v for k, v in group.items() if len(v) == most}
        best_key = min(complete, key=lambda k: float(np.mean(np.log(complete[k]))))
        notes.append(
            f"tune: best launch by geometric mean over the {most} tuned case(s) with "
            f"write_final={write_final}: {best_key[1]}"
        )
    return notes


def _launch_label(entry: dict[str, Any]) -> str:
    return " ".join(f"{name}={entry[name]}" for name in LAUNCH_PARAMETERS if name in entry)


# ----------------------------------------------------------------------------------------------
# Several new tokens per request (speculative verification)


def multi_token_case(batch: int, context: int, q_len: int) -> str:
    """The report's name of a multi-token case, e.g. ``"B=64 ctx=4096 q_len=5"``."""
    return f"{case_name(batch, context)} q_len={q_len}"


def xla_gather_causal_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    output_dtype=None,
) -> jax.Array:
    """Attention of each request's last ``L`` tokens, causal among them, the obvious way in
    ``jnp`` (the ``xla_gather`` arm of the multi-token cases; ``peers.xla_gather_attention``
    with a query axis).

    Args:
      q: ``[B, L, H, D]``; query ``l`` of request ``b`` sits at position ``seq_lens[b] - L + l``.
      k_pages, v_pages: head-major pools ``[KVH, num_pages, page_size, D]``.
      block_tables: int32 ``[B, pages_per_sequence]``.
      seq_lens: int32 ``[B]``, each at least ``L``.
      sm_scale: the logit scale.
      output_dtype: default q's dtype; float32 for a reference.

    Returns:
      ``[B, L, H, D]``.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    keys, values = peers.gathered_kv(k_pages, v_pages, block_tables)
    grouped_q = q.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("blkgd,kbtd->blkgt", grouped_q, keys, preferred_element_type=jnp.float32)
    logits = logits * sm_scale
    key_position = jnp.arange(keys.shape[2], dtype=jnp.int32)
    query_position = seq_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)  # [B, L]
    visible = key_position[None, None, :] <= query_position[:, :, None]  # [B, L, tokens]
    logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    output = jnp.einsum(
        "blkgt,kbtd->blkgd",
        weights.astype(values.dtype),
        values,
        preferred_element_type=jnp.float32,
    )
    return output.reshape(batch, q_len, num_heads, head_dim).astype(output_dtype or q.dtype)


def multi_token_queries(setup: AttentionSetup, q_len: int) -> jax.Array:
    """Standard normal ``[num_sets, B, L, H, D]`` queries in the pool's dtype (as the setup's)."""
    shape = (setup.num_sets, setup.batch, q_len, setup.num_q_heads, setup.head_dim)
    return jax.random.normal(jax.random.key(q_len), shape, setup.queries.dtype)


def _causal_reference(setup: AttentionSetup, queries: jax.Array) -> np.ndarray:
    """float32 ``[B, L, H, D]`` output of set 0, the XLA arm's function in float32."""
    k_pages, v_pages = setup.pool(peers.PEER_ATTENTION_LAYOUT)
    output = jax.jit(xla_gather_causal_attention, static_argnames=("sm_scale", "output_dtype"))(
        queries[0],
        k_pages,
        v_pages,
        setup.block_tables[0],
        setup.seq_lens,
        sm_scale=setup.sm_scale,
        output_dtype=jnp.float32,
    )
    return np.asarray(output)


def multi_token_results(
    batch: int,
    context: int,
    q_lens: tuple[int, ...],
    shape: dict[str, int],
    options: RunOptions,
    ceiling_tbps: float,
    notes: list[str],
) -> list[CaseResult]:
    """The API and the XLA arm for each ``q_len`` on one (batch, context) pool; the first
    ``q_len`` of ``q_lens`` is the one the others are compared with (``vs_q_len_1``)."""
    num_sets = options.num_sets_for(kv_bytes_per_set(batch, context, **shape))
    setup = make_attention_setup(
        batch, context, **shape, layouts=("HND", peers.PEER_ATTENTION_LAYOUT), num_sets=num_sets
    )
    results: list[CaseResult] = []
    base_us = None
    try:
        backend = api_backend(setup, options)
        # One plan a kernel serves every q_len: plans do not depend on it.
        plans = {b: plan_for_backend(setup, b) for _, b in api_arms(backend)}
        plan = plans[backend]
        for q_len in q_lens:
            case = multi_token_case(batch, context, q_len)
            report.print_progress(f"{case}: timing decodelab and xla_gather")
            queries = multi_token_queries(setup, q_len)
            try:
                reference = _causal_reference(setup, queries)
                api_rows = []
                for arm, arm_backend in api_arms(backend):
                    loop = api_loop(setup, plans[arm_backend], queries, backend=arm_backend)
                    difference = peers.max_abs_difference(loop.output(0), reference)
                    if not difference <= DISAGREEMENT_TOLERANCE:
                        notes.append(f"{case}: {arm} differs from xla_gather by {difference:.3g}")
                    api_rows.append(
                        _timed_row(
                            setup,
                            options,
                            ceiling_tbps,
                            loop,
                            arm,
                            f"paged.decode_attention({arm_backend}):",
                            plans[arm_backend],
                            case=case,
                            q_len=q_len,
                            backend=arm_backend,
                            max_abs_difference_from_xla_gather=difference,
                        )
                    )
                api = api_rows[0]
                base_us = api.median_us if base_us is None else base_us
                api.extra["vs_q_len_1"] = api.median_us / base_us
                xla_timing = options.time(
                    peers.xla_gather_loop(setup, queries, xla_gather_causal_attention),
                    expected_us_per_call=expected_us(
                        setup.kv_bytes_per_set, EXPECTED_XLA_GATHER_TBPS
                    ),
                )
                xla = CaseResult.from_timing(
                    case,
                    "xla_gather",
                    f"xla:gather+einsum+causal_softmax:q_len={q_len}",
                    xla_timing,
                    setup.kv_bytes_per_set,
                    ceiling_tbps,
                    q_len=q_len,
                )
                repeat = _timed_row(
                    setup,
                    options,
                    ceiling_tbps,
                    api_loop(setup, plan, queries, backend=backend),
                    repeat_arm("decodelab"),
                    f"paged.decode_attention({backend}):",
                    plan,
                    iters=api.extra["iters"],
                    case=case,
                    q_len=q_len,
                    backend=backend,
                )
                rows = [*api_rows, xla, repeat]
                results += rows
                report.print_results(rows)
            finally:
                queries.delete()
    finally:
        gc.collect()
        setup.delete()
    return results
