"""The ``prefill`` suite: one prompt chunk's attention, the causal prefill kernel against the
reference (and, with ``--tune``, a sweep of the kernel's launch parameters).

``python -m bench prefill`` on a GPU times, for one 512-token chunk at the end of a 16K- and a
32K-token sequence (the chunk's tokens are the last 512; the other keys are the prompt's earlier
chunks, already in the cache), Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim
128, pages of 16, bfloat16, HND pool, B=1):

- ``reference``: ``paged.decode_attention(..., backend="reference")``, what a prompt chunk ran
  before the prefill kernel existed (it gathers every page of the table, per chunk);
- ``decodelab``: ``paged.decode_attention(..., backend="pallas")``, the public API, which runs
  ``kernels_pallas.paged_prefill`` with ``launch_parameters``' defaults (plus the two small
  copies that put q in the kernel's row order and the output back);
- with ``--tune``, ``kernel q<block_q> p<pages> w<warps> s<stages>``: the raw ``paged_prefill``
  for each launch of ``SWEEP`` (query blocks of 16, 32, 64 tokens = 64, 128, 256 rows at G = 4;
  2, 4, 8 pages a step; 4 or 8 warps; 1, 2 or 3 pipeline stages). A launch Triton cannot compile
  (too much shared memory) is recorded in a note and skipped.

Prefill of a long chunk is compute bound, so its figures are FLOPs, not bytes: each row's
``achieved_tflops`` (``paged_prefill.prefill_flops``: ``4 x H x D`` per visible (query, key)
pair, 135 GFLOP at 16K, 271 at 32K) and ``fraction_of_peak``, of the H200's nominal dense
bfloat16 peak, 989 TFLOP/s. The report's bytes are the K and V of the chunk's sequence (64 MiB at
16K), a floor of ~16 us against a compute floor of ~137 us; its TB/s and fraction of the copy
ceiling are recorded because every report has them, not because they bound this kernel.

Method (``docs/benchmarking.md``, ``bench/harness/timing.py``): each arm is ``N`` calls inside
one jitted ``lax.fori_loop``, each result folded into a carried checksum, median of the repeats;
the page tables of ``num_rotating_sets`` disjoint page sets are rotated over one pool so that 4x
the L2 lies between two visits of a set (cold L2); the query is one random array. The reference
takes about a second a call, so it gets 3 repeats. Each arm's attribution names the Triton
kernel its program calls (read from the lowered program), so the arms cannot be confused; the
API's output is checked against the reference's.

``--contexts 32768`` runs one context (a sweep adds a Triton compilation and about half a second
of timing per launch: where one command is limited in time, sweep one context a run). ``--quick``
runs the 16K context alone. Without a sweep, about 40 s on an H200.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import paged
from bench.harness import CaseResult, CopyCeiling, RunOptions, TimedLoop, expected_us, report
from bench.suites import SuiteOutput, peers
from kernels_pallas.paged_prefill import launch_parameters, paged_prefill, prefill_flops

H200_DENSE_BF16_TFLOPS = 989.0
CONTEXTS = (16384, 32768)
QUICK_CONTEXTS = (16384,)
CHUNK = 512
STANDARD_SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
DRY_RUN_CONTEXTS = (80,)
DRY_RUN_CHUNK = 40
DRY_RUN_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
SWEEP = [
    {"block_q": block_q, "pages_per_step": pages, "num_warps": warps, "num_stages": stages}
    for block_q, pages, warps, stages in itertools.product(
        (16, 32, 64), (2, 4, 8), (4, 8), (1, 2, 3)
    )
]
DRY_RUN_SWEEP = [
    {"block_q": 16, "pages_per_step": 2, "num_warps": 4, "num_stages": 1},
    {"block_q": 4, "pages_per_step": 1, "num_warps": 4, "num_stages": 2},
]
REFERENCE_REPEATS = 3
# Priors for sizing the first timed program (harness.expected_us): a second-long program of the
# reference at ~0.5 TFLOP/s, the kernel at ~300.
REFERENCE_PRIOR_TFLOPS = 0.5
KERNEL_PRIOR_TFLOPS = 300.0
# Relative error of the API's bfloat16 output against the reference's: the project's bfloat16
# bound for a kernel against its reference (the first H200 run measured about 2e-3).
DISAGREEMENT_TOLERANCE = 1e-2
REFERENCE_ATTRIBUTION = "xla:gather+masked_softmax"
COMPUTE_BOUND_NOTE = (
    "prefill of a long chunk is compute bound: read each row's achieved_tflops and "
    f"fraction_of_peak (of a nominal {H200_DENSE_BF16_TFLOPS:.0f} TFLOP/s dense bfloat16 peak); "
    "bytes are the K and V of the chunk's sequence, a floor, not a bound"
)


def case_name(context: int, chunk: int) -> str:
    """The report's name of a case, e.g. ``"B=1 ctx=16384 q_len=512"``."""
    return f"B=1 ctx={context} q_len={chunk}"


def kernel_arm(launch: dict[str, int]) -> str:
    """The arm of the raw kernel at ``launch``, e.g. ``"kernel q16 p2 w4 s1"``."""
    return (
        f"kernel q{launch['block_q']} p{launch['pages_per_step']} w{launch['num_warps']} "
        f"s{launch['num_stages']}"
    )


def run(options: RunOptions, ceiling: CopyCeiling) -> SuiteOutput:
    """Times the reference, the API and (with ``options.tune``) the launch sweep on each
    context (module docstring)."""
    shape = DRY_RUN_SHAPE if options.dry_run else STANDARD_SHAPE
    chunk = DRY_RUN_CHUNK if options.dry_run else CHUNK
    if options.contexts is not None:
        contexts = options.contexts
    elif options.dry_run:
        contexts = DRY_RUN_CONTEXTS
    else:
        contexts = QUICK_CONTEXTS if options.quick else CONTEXTS
    sweep = (DRY_RUN_SWEEP if options.dry_run else SWEEP) if options.tune else []
    dtype = jnp.float32 if options.dry_run else jnp.bfloat16
    results: list[CaseResult] = []
    notes = [COMPUTE_BOUND_NOTE, f"the reference arm: {REFERENCE_REPEATS} repeats"]
    for context in contexts:
        if context < chunk:
            raise ValueError(
                f"--contexts: each context must be at least the chunk ({chunk}), got {context}"
            )
        report.print_progress(
            f"{case_name(context, chunk)}: setting up, then timing reference, decodelab"
            + (f" and {len(sweep)} launches" if sweep else "")
        )
        rows = run_case(
            context, chunk, shape, options, ceiling.tbps, notes, sweep=sweep, dtype=dtype
        )
        results += rows
    return SuiteOutput(results=results, notes=notes, peers_for_ratio=("reference", "decodelab"))


@dataclasses.dataclass
class Inputs:
    """One case's inputs: a query, one pool, and the page tables of the rotating sets.

    Attributes:
      q: ``[1, chunk, H, D]`` bfloat16 (float32 in a dry run).
      k_pages, v_pages: ``[num_pages, KVH, page_size, D]``; page 0 unused.
      page_indptr, last_page_len: the one request's table arrays, the same for every set.
      page_indices: ``[num_sets, pages_per_set]``: each set's pages, disjoint, scattered.
    """

    context: int
    chunk: int
    shape: dict[str, int]
    num_sets: int
    q: Any
    k_pages: Any
    v_pages: Any
    page_indptr: Any
    page_indices: Any
    last_page_len: Any

    @property
    def sm_scale(self) -> float:
        return self.shape["head_dim"] ** -0.5

    def operands(self):
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.page_indptr,
            self.page_indices,
            self.last_page_len,
        )

    def delete(self) -> None:
        for array in self.operands():
            array.delete()


def make_inputs(context: int, chunk: int, shape: dict[str, int], options, dtype) -> Inputs:
    """Random normal query and pool, generated on the device; pages of each set a random
    permutation scattered over the pool (page 0 left out)."""
    page_size, num_kv_heads, head_dim = shape["page_size"], shape["num_kv_heads"], shape["head_dim"]
    kv_bytes = 2 * context * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    num_sets = options.num_sets_for(kv_bytes)
    pages_per_set = -(-context // page_size)
    num_pages = 1 + num_sets * pages_per_set
    key_q, key_k, key_v, key_perm = jax.random.split(jax.random.key(context), 4)
    pool_shape = (num_pages, num_kv_heads, page_size, head_dim)
    permutation = 1 + jax.random.permutation(key_perm, num_pages - 1).astype(jnp.int32)
    last = context - (pages_per_set - 1) * page_size
    return Inputs(
        context=context,
        chunk=chunk,
        shape=shape,
        num_sets=num_sets,
        q=jax.random.normal(key_q, (1, chunk, shape["num_q_heads"], head_dim), dtype),
        k_pages=jax.random.normal(key_k, pool_shape, dtype),
        v_pages=jax.random.normal(key_v, pool_shape, dtype),
        page_indptr=jnp.asarray([0, pages_per_set], jnp.int32),
        page_indices=permutation.reshape(num_sets, pages_per_set),
        last_page_len=jnp.asarray([last], jnp.int32),
    )


def _table(page_indptr, page_indices, last_page_len, set_index, page_size):
    return paged.PageTable(page_indptr, page_indices[set_index], last_page_len, page_size)


def api_loop(inputs: Inputs, backend: str) -> TimedLoop:
    """One call = ``paged.decode_attention`` of the chunk on rotating set ``set_index``."""

    def step(set_index, operands):
        q, k_pages, v_pages, page_indptr, page_indices, last_page_len = operands
        table = _table(
            page_indptr, page_indices, last_page_len, set_index, inputs.shape["page_size"]
        )
        cache = paged.KVCache(k_pages, v_pages, "HND")
        return paged.decode_attention(q, cache, table, backend=backend)

    return TimedLoop(step, inputs.num_sets, inputs.operands())


def kernel_loop(inputs: Inputs, launch: dict[str, int], interpret: bool) -> TimedLoop:
    """One call = the raw prefill kernel with ``launch`` on rotating set ``set_index``."""

    def step(set_index, operands):
        q, k_pages, v_pages, page_indptr, page_indices, last_page_len = operands
        return paged_prefill(
            q,
            k_pages,
            v_pages,
            page_indices[set_index],
            page_indptr,
            last_page_len,
            layout="HND",
            sm_scale=inputs.sm_scale,
            logits_soft_cap=None,
            interpret=interpret,
            **launch,
        )

    return TimedLoop(step, inputs.num_sets, inputs.operands())


def kernel_names(loop: TimedLoop, options: RunOptions) -> str:
    """The Triton prefill kernels a loop's program calls (``interpret`` where nothing is
    compiled, ``no-triton-kernel-found`` where it calls none)."""
    if options.interpret:
        return "interpret"
    names = peers.triton_kernel_names(loop.lowered_text(), "paged_prefill")
    return "+".join(names) if names else "no-triton-kernel-found"


def timed_row(
    inputs: Inputs,
    loop: TimedLoop,
    options: RunOptions,
    ceiling_tbps: float,
    *,
    arm: str,
    attribution: str,
    prior_tflops: float,
    **extra: Any,
) -> CaseResult:
    """Times ``loop`` and returns its row, with the FLOP figures in ``extra``."""
    shape = inputs.shape
    flops = prefill_flops([inputs.context], inputs.chunk, shape["num_q_heads"], shape["head_dim"])
    kv_bytes = (
        2 * inputs.context * shape["num_kv_heads"] * shape["head_dim"] * inputs.q.dtype.itemsize
    )
    prior = expected_us(flops, prior_tflops)  # "bytes" at "TB/s": FLOPs at TFLOP/s, same units
    timing = options.time(loop, expected_us_per_call=prior, sweep=arm.startswith("kernel"))
    achieved_tflops = flops / (timing.median_us * 1e-6) / 1e12
    return CaseResult.from_timing(
        case_name(inputs.context, inputs.chunk),
        arm,
        attribution,
        timing,
        kv_bytes,
        ceiling_tbps,
        flops=flops,
        achieved_tflops=achieved_tflops,
        fraction_of_peak=achieved_tflops / H200_DENSE_BF16_TFLOPS,
        **extra,
    )


def run_case(
    context: int,
    chunk: int,
    shape: dict[str, int],
    options: RunOptions,
    ceiling_tbps: float,
    notes: list[str],
    *,
    sweep: list[dict[str, int]],
    dtype,
) -> list[CaseResult]:
    """Every arm of one context; prints the rows once the case is complete."""
    case = case_name(context, chunk)
    rows = []
    inputs = make_inputs(context, chunk, shape, options, dtype)
    try:
        reference_options = dataclasses.replace(
            options, repeats=min(options.repeats, REFERENCE_REPEATS)
        )
        reference = api_loop(inputs, "reference")
        rows.append(
            timed_row(
                inputs,
                reference,
                reference_options,
                ceiling_tbps,
                arm="reference",
                attribution=REFERENCE_ATTRIBUTION,
                prior_tflops=REFERENCE_PRIOR_TFLOPS,
            )
        )
        api = api_loop(inputs, "pallas")
        default = launch_parameters(
            shape["head_dim"], shape["num_q_heads"] // shape["num_kv_heads"], shape["page_size"]
        )
        row = timed_row(
            inputs,
            api,
            options,
            ceiling_tbps,
            arm="decodelab",
            attribution="paged.decode_attention:" + kernel_names(api, options),
            prior_tflops=KERNEL_PRIOR_TFLOPS,
            **default,
        )
        expected = np.asarray(reference.output(0), np.float32)
        got = np.asarray(api.output(0), np.float32)
        error = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
        row.extra["relative_error_vs_reference"] = error
        if not error < DISAGREEMENT_TOLERANCE:
            notes.append(f"{case}: the API differs from the reference by {error:.3g}")
        rows.append(row)
        del reference, api
        gc.collect()
        for launch in sweep:
            try:
                loop = kernel_loop(inputs, launch, options.interpret)
                names = kernel_names(loop, options)
                if options.interpret:  # nothing compiled to name: the launch tells arms apart
                    names += f":{kernel_arm(launch).removeprefix('kernel ')}"
                rows.append(
                    timed_row(
                        inputs,
                        loop,
                        options,
                        ceiling_tbps,
                        arm=kernel_arm(launch),
                        attribution="kernel_only:" + names,
                        prior_tflops=KERNEL_PRIOR_TFLOPS,
                        **launch,
                    )
                )
            except Exception as error:  # a launch Triton cannot build (shared memory): record it
                first_line = str(error).splitlines()[0][:200] if str(error) else ""
                message = f"{type(error).__name__}: {first_line}"
                report.print_progress(f"{case}: launch {launch} failed: {message}")
                notes.append(f"{case}: launch {launch} failed ({message})")
            gc.collect()
    finally:
        inputs.delete()
    report.print_results(rows)
    best = min(
        (r for r in rows if r.arm.startswith("kernel")), key=lambda r: r.median_us, default=None
    )
    if best is not None:
        notes.append(
            f"{case}: best launch {best.arm.removeprefix('kernel ')} at {best.median_us:.1f} us "
            f"({best.extra['achieved_tflops']:.1f} TFLOP/s); the API's default "
            + kernel_arm(default).removeprefix("kernel ")
        )
    return rows
